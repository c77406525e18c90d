"""Runs one engine step on the model: builds the step's tensors (ids, positions, slots,
masks) from the scheduled sequences, runs the forward and samples. Per-step host work is
O(batch) list building; a decode step's inputs (token, position, page-table row, cache
entry, seed, step of each sequence) go to the device in one copy, everything per token or
per layer stays on the device, and the only device->host sync is reading the sampled
tokens and their log-probs.
"""
from __future__ import annotations

import torch

from minisparse.engine.config import SamplingParams
from minisparse.engine.kv_pool import KVPool
from minisparse.engine.layers.attention import AttnContext
from minisparse.engine.layers.sampler import sample
from minisparse.engine.models import CausalLM
from minisparse.engine.sequence import Sequence

_ALIGN = 16  # attended length is padded to a multiple of this (SDPA mask alignment)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class ModelRunner:
    def __init__(self, lm: CausalLM, pool: KVPool, cuda_graphs: bool = False,
                 graph_max_len: int | None = None) -> None:
        """cuda_graphs: capture decode steps (on CUDA); graph_max_len: the longest cache the
        graphs serve (the compression bound; None: the pool's max_model_len)."""
        self.lm, self.pool, self.device = lm, pool, pool.device
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.graph_max_len = graph_max_len
        self.graphs = None  # a cuda_graph.DecodeGraphs when the decode step is captured
        self._pinned: torch.Tensor | None = None  # staging buffer of decode's step tensor
        self.reset_graphs()

    def reset_graphs(self) -> None:
        """Fresh (empty, lazily captured) decode graphs. Graphs bake in the pool's and the
        weights' addresses: call this after either changes."""
        self.graphs = None
        if self.cuda_graphs and self.pool.allocated:
            from minisparse.engine.cuda_graph import DecodeGraphs  # it imports this module

            max_len = self.graph_max_len or self.pool.max_model_len
            self.graphs = DecodeGraphs(self.lm, self.pool, max_len)

    def release_graphs(self) -> None:
        """Drop the graphs (and their memory pool), before the KV pool is released."""
        self.graphs = None

    def _tensor(self, values: list, dtype=torch.long) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _ring(self, rows: list[int], ends: list[int], lens: list[int], offsets: list[int]):
        """Queries to keep: the last min(W, n) tokens of each chunk, at ring row
        slot * W + pos % W."""
        W = self.pool.window
        if not W:
            return None, None
        src, dst = [], []
        for row, end, n, off in zip(rows, ends, lens, offsets):
            for p in range(end - min(W, n), end):
                src.append(off + p - (end - n))
                dst.append(row * W + p % W)
        return self._tensor(src), self._tensor(dst)

    @torch.inference_mode()
    def prefill(self, chunks: list[tuple[Sequence, int]], sp: SamplingParams):
        """Compute chunks (seq, n tokens from seq.num_computed). Samples for the sequences
        whose chunk reaches their last token; returns them with (tokens, logprobs)."""
        ids, rows, starts, lens, offsets = [], [], [], [], []
        for seq, n in chunks:
            offsets.append(len(ids))
            ids.extend(seq.token_ids[seq.num_computed: seq.num_computed + n])
            rows.append(seq.slot), starts.append(seq.num_computed), lens.append(n)
        B, T = len(chunks), max(lens)
        dev = self.device
        row_t, start_t, len_t, off_t = (self._tensor(x) for x in (rows, starts, lens, offsets))
        t = torch.arange(T, device=dev)
        tt = torch.minimum(t[None, :], len_t[:, None] - 1)  # pad queries repeat the last one
        q_index = off_t[:, None] + tt
        token_rows = torch.arange(B * T, device=dev).view(B, T)[t[None, :] < len_t[:, None]]
        pos = start_t[:, None] + tt  # prefill: cache index == position
        tok_pos = pos[t[None, :] < len_t[:, None]]
        tok_row = row_t.repeat_interleave(len_t)
        L = _round_up(max(s + n for s, n in zip(starts, lens)), _ALIGN)
        mask = torch.arange(L, device=dev)[None, None, :] <= pos[:, :, None]
        ring_src, ring_dst = self._ring(rows, [s + n for s, n in zip(starts, lens)], lens, offsets)
        ctx = AttnContext(self.pool.slot_of(tok_row, tok_pos), ring_src, ring_dst,
                          gather_slots=self.pool.slots(row_t, L), mask=mask.unsqueeze(1),
                          q_index=q_index, token_rows=token_rows)
        hidden = self.lm.forward(self._tensor(ids), tok_pos, ctx, self.pool.k, self.pool.v,
                                 self.pool.q_ring)
        done = [i for i, (seq, n) in enumerate(chunks) if seq.num_computed + n == len(seq)]
        if not done:
            return [], [], []
        last = self._tensor([offsets[i] + lens[i] - 1 for i in done])
        seqs = [chunks[i][0] for i in done]
        seeds = self._tensor([s.seed for s in seqs])
        steps = self._tensor([s.num_generated for s in seqs])
        tokens, logprobs = self._sample(hidden[last], seeds, steps, sp)
        return seqs, tokens, logprobs

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], sp: SamplingParams):
        """One token for each sequence (its last token goes in at cache index cache_len)."""
        B = len(seqs)
        flat = [x for s in seqs for x in (s.last_token, s.num_computed, s.slot, s.cache_len,
                                          s.seed, len(s.token_ids) - s.num_prompt)]
        step = self._upload(torch.tensor(flat, dtype=torch.long).view(B, 6).t())
        ids, pos, rows, cidx, seeds, steps = step  # one host->device copy
        max_len = max(s.cache_len for s in seqs) + 1
        if self.graphs is not None and self.graphs.fits(B, max_len):
            hidden = self.graphs.run(ids, pos, rows, cidx, max_len)
        else:
            hidden = decode_forward(self.lm, self.pool, ids, pos, rows, cidx, max_len)
        return self._sample(hidden, seeds, steps, sp)

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        """A small CPU tensor on the device, through a reused pinned buffer on CUDA (safe:
        every step ends with a device->host sync, so the previous copy has completed)."""
        if self.device.type != "cuda":
            return t.contiguous()
        n = t.numel()
        if self._pinned is None or self._pinned.numel() < n:
            self._pinned = torch.empty(max(n, 4096), dtype=torch.long, pin_memory=True)
        buf = self._pinned[:n].view(t.shape)
        buf.copy_(t)
        return buf.to(self.device, non_blocking=True)

    def _sample(self, hidden: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                sp: SamplingParams):
        logits = self.lm.logits(hidden)
        tokens, logprobs = sample(logits, sp.temperature, sp.top_k, sp.top_p, seeds, steps)
        out = torch.stack([tokens.double(), logprobs.double()]).cpu()  # the step's one sync
        return [int(x) for x in out[0].tolist()], out[1].tolist()


def decode_forward(lm: CausalLM, pool: KVPool, ids: torch.Tensor, pos: torch.Tensor,
                   rows: torch.Tensor, cidx: torch.Tensor, max_len: int) -> torch.Tensor:
    """Hidden states [B, hidden] of one decode step from device tensors only (token, RoPE
    position, page-table row, cache entry of each sequence; max_len >= every cidx + 1), so
    the same function runs eagerly and under CUDA-graph capture."""
    ring_src = ring_dst = None
    if pool.window:
        ring_src = torch.arange(ids.shape[0], device=ids.device)
        ring_dst = rows * pool.window + pos % pool.window
    ctx = AttnContext(pool.slot_of(rows, cidx), ring_src, ring_dst, page_table=pool.page_table,
                      rows=rows, cache_lens=cidx + 1, max_len=max_len, page_size=pool.page_size)
    return lm.forward(ids, pos, ctx, pool.k, pool.v, pool.q_ring)
