"""Runs one engine step on the model: builds the step's tensors (ids, positions, slots,
masks) from the scheduled sequences, runs the forward and samples. Per-step host work is
O(batch) list building; a decode step's inputs (token, position, page-table row, cache
entry, seed, step of each sequence) go to the device in one copy, everything per token or
per layer stays on the device, and the only device->host sync is reading the sampled
tokens and their log-probs. A decode step is queued (launch) and read (collect)
separately, so the engine can queue the next step, its inputs built on the device from
this one's (next_inputs), before it waits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minisparse.engine.config import SamplingParams
from minisparse.engine.cuda_graph import DecodeGraphs
from minisparse.engine.kv_pool import KVPool
from minisparse.engine.layers.attention import AttnContext
from minisparse.engine.models import CausalLM
from minisparse.engine.sequence import Sequence
from minisparse.engine.step import decode_forward, sample_hidden
from minisparse.utils.transfer import to_device

_ALIGN = 16  # attended length is padded to a multiple of this (SDPA mask alignment)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass
class DecodeLaunch:
    """A decode step on its way: its batch, its inputs [6, B] on the device (token,
    position, page-table row, cache entry, seed, step of each sequence), its sampled
    tokens on the device, and the host copy of (tokens, logprobs) that collect() waits
    for. cache_lens: each sequence's cache length including this step's entry."""
    seqs: list[Sequence]
    inputs: torch.Tensor
    tokens: torch.Tensor
    host: torch.Tensor
    ready: torch.cuda.Event | None
    cache_lens: list[int]
    graph: bool = False  # replayed from a captured CUDA graph


class ModelRunner:
    def __init__(self, lm: CausalLM, pool: KVPool, cuda_graphs: bool = False,
                 graph_max_len: int | None = None) -> None:
        """cuda_graphs: capture decode steps (on CUDA); graph_max_len: the longest cache the
        graphs serve (the compression bound; None: the pool's max_model_len)."""
        self.lm, self.pool, self.device = lm, pool, pool.device
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.graph_max_len = graph_max_len
        self.graphs: DecodeGraphs | None = None  # when the decode step is captured
        self._pinned: torch.Tensor | None = None  # staging buffer of decode's step tensor
        self._outs: list[torch.Tensor] = []  # pinned (tokens, logprobs) of 2 launches
        self._launches = 0
        self.reset_graphs()

    def reset_graphs(self) -> None:
        """Fresh (empty, lazily captured) decode graphs. Graphs bake in the pool's and the
        weights' addresses: call this after either changes."""
        self.graphs = None
        if self.cuda_graphs and self.pool.allocated:
            max_len = self.graph_max_len or self.pool.max_model_len
            self.graphs = DecodeGraphs(self.lm, self.pool, max_len)

    def release_graphs(self) -> None:
        """Drop the graphs (and their memory pool), before the KV pool is released."""
        self.graphs = None

    def _tensor(self, values: list, dtype=torch.long) -> torch.Tensor:
        return to_device(values, self.device, dtype)

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

    def step_inputs(self, seqs: list[Sequence]) -> torch.Tensor:
        """A decode step's inputs [6, B] from the sequences' host state, in one copy."""
        flat = [x for s in seqs for x in (s.last_token, s.num_computed, s.slot, s.cache_len,
                                          s.seed, len(s.token_ids) - s.num_prompt)]
        return self._upload(torch.tensor(flat, dtype=torch.long).view(len(seqs), 6).t())

    def next_inputs(self, prev: DecodeLaunch, keep: list[int] | None,
                    cache_lens: list[int] | None = None) -> torch.Tensor:
        """The inputs of the step after `prev` for prev's sequences at positions `keep`
        (None: all), built on the device: prev's sampled token goes in one position and
        cache entry further on, at the next sampling step. Needs no host copy of prev's
        tokens, so it can be launched before they are read. cache_lens: each kept
        sequence's cache length now, when a compaction since `prev` shortened some (their
        next entry is then not prev's + 1)."""
        ids, pos, rows, cidx, seeds, steps = prev.inputs
        nxt = torch.stack([prev.tokens.long(), pos + 1, rows, cidx + 1, seeds, steps + 1])
        if keep is not None:
            nxt = nxt[:, to_device(keep, self.device)]
        if cache_lens is not None:
            nxt[3] = to_device(cache_lens, self.device)
        return nxt

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], sp: SamplingParams,
               inputs: torch.Tensor) -> DecodeLaunch:
        """Queue one decode step (inputs [6, B] on the device, as step_inputs builds them)
        and the copy of its results to the host; returns without waiting for either."""
        ids, pos, rows, cidx, seeds, steps = inputs
        max_len = max(s.cache_len for s in seqs) + 1
        graph = self.graphs is not None and self.graphs.fits(len(seqs), max_len)
        if graph:
            tokens, logprobs = self.graphs.run(ids, pos, rows, cidx, seeds, steps, max_len, sp)
        else:
            hidden = decode_forward(self.lm, self.pool, ids, pos, rows, cidx, max_len)
            tokens, logprobs = sample_hidden(self.lm, hidden, seeds, steps, sp)
        out = torch.stack([tokens.double(), logprobs.double()])
        ready = None
        if self.device.type == "cuda":
            out, ready = self._to_pinned(out), torch.cuda.Event()
            ready.record()
        return DecodeLaunch(seqs, inputs, tokens, out, ready, [s.cache_len + 1 for s in seqs],
                            graph and self.graphs.use_graphs)

    def collect(self, launch: DecodeLaunch) -> tuple[list[int], list[float]]:
        """Wait for a launched step's (tokens, logprobs) and return them as host lists."""
        if launch.ready is not None:
            launch.ready.synchronize()
        return [int(x) for x in launch.host[0].tolist()], launch.host[1].tolist()

    def _to_pinned(self, out: torch.Tensor) -> torch.Tensor:
        """Copy [2, B] to one of two pinned buffers, alternating: at most two launches are
        uncollected at a time (the engine collects step N before launching N + 2)."""
        n = out.numel()
        if not self._outs or self._outs[0].numel() < n:
            size = max(n, 2 * self.pool.cfg.max_num_seqs)
            self._outs = [torch.empty(size, dtype=torch.float64, pin_memory=True)
                          for _ in range(2)]
        self._launches += 1
        # a contiguous destination: a strided one makes copy_ stage through a temporary
        # and return only once the step is done, which would undo the overlap
        host = self._outs[self._launches % 2][:n].view(out.shape)
        host.copy_(out, non_blocking=True)
        return host

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        """A small CPU tensor on the device, through a reused pinned buffer on CUDA (safe:
        step_inputs is called only after the previous step was collected, so the previous
        copy has completed; overlapped steps build their inputs on the device)."""
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
        return self._to_host(*sample_hidden(self.lm, hidden, seeds, steps, sp))

    def _to_host(self, tokens: torch.Tensor, logprobs: torch.Tensor):
        out = torch.stack([tokens.double(), logprobs.double()]).cpu()  # the step's one sync
        return [int(x) for x in out[0].tolist()], out[1].tolist()
