"""Decode-step CUDA graphs, one per (batch-size bucket, cache-length bucket, sampling
settings), captured lazily on first use.

A graph runs step.py's decode_forward and sample_hidden (LM head and sampler) on static
buffers of its batch size, so a replay returns the step's tokens and log-probs; a smaller
batch is padded with rows that point at the pool's scratch page (page-table row
scratch_row, cache entry 0), so padding writes and attends only there. The cache-length bucket (a power of two,
capped at max_len: the compression bound, or max_model_len when dense) is the upper bound
the Triton decode kernel sizes its splits by; batches whose caches exceed max_len run
eagerly. With use_graphs=False the same padded path runs eagerly, which is how the
padding logic is tested on CPU.

Graphs bake in the pool and weight tensors' addresses: the engine drops them on sleep()
and update_weights() and they are re-captured on demand.
"""
from __future__ import annotations

import torch

from minisparse.engine.config import SamplingParams
from minisparse.engine.kv_pool import KVPool
from minisparse.engine.models import CausalLM
from minisparse.engine.step import decode_forward, sample_hidden


MIN_LEN_BUCKET = 256


def batch_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, then every multiple of 32, up to (and including) max_bs."""
    sizes = [b for b in (1, 2, 4, 8, 16) if b < max_bs] + list(range(32, max_bs, 32))
    return sizes + [max_bs]


class DecodeGraphs:
    def __init__(self, lm: CausalLM, pool: KVPool, max_len: int, use_graphs: bool = True) -> None:
        self.lm, self.pool, self.max_len, self.use_graphs = lm, pool, max_len, use_graphs
        max_bs = pool.cfg.max_num_seqs
        self.buckets = batch_buckets(max_bs)
        dev = pool.device
        self.ids = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.pos = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.rows = torch.full((max_bs,), pool.scratch_row, dtype=torch.long, device=dev)
        self.cidx = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.seeds = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.steps = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.mempool = None

    def fits(self, batch: int, max_len: int) -> bool:
        return batch <= self.buckets[-1] and max_len <= self.max_len

    def len_bucket(self, max_len: int) -> int:
        return min(self.max_len, max(MIN_LEN_BUCKET, 1 << (max_len - 1).bit_length()))

    def run(self, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor,
            cidx: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, max_len: int,
            sp: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B], logprobs [B]) on the device; needs fits(B, max_len)."""
        B = ids.shape[0]
        bs = next(b for b in self.buckets if b >= B)
        key = (bs, self.len_bucket(max_len), sp.temperature, sp.top_k, sp.top_p)
        for static, value in ((self.ids, ids), (self.pos, pos), (self.rows, rows),
                              (self.cidx, cidx), (self.seeds, seeds), (self.steps, steps)):
            static[:B] = value
        self.rows[B:bs] = self.pool.scratch_row  # padding: scratch page, entry 0
        self.ids[B:bs], self.pos[B:bs], self.cidx[B:bs] = 0, 0, 0
        if not self.use_graphs:
            tokens, logprobs = self._forward(key)
        else:
            if key not in self.graphs:
                self._capture(key)
            self.graphs[key].replay()
            tokens, logprobs = self.outputs[key]
        return tokens[:B], logprobs[:B]

    def _forward(self, key: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        bs, max_len, temperature, top_k, top_p = key
        sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        hidden = decode_forward(self.lm, self.pool, self.ids[:bs], self.pos[:bs],
                                self.rows[:bs], self.cidx[:bs], max_len)
        return sample_hidden(self.lm, hidden, self.seeds[:bs], self.steps[:bs], sp)

    def _capture(self, key: tuple) -> None:
        """Warm up on a side stream (Triton compile, cuBLAS handles), then capture. The
        warm-up writes the same K/V and queries the replay will write, so it is harmless."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(key)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            self.outputs[key] = self._forward(key)
        if self.mempool is None:
            self.mempool = graph.pool()
        self.graphs[key] = graph
