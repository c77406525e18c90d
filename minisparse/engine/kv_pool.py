"""The preallocated KV pool: K and V for every layer in pages of page_size slots, the
device page table, and (with compression) the ring of each sequence's last W queries.

Layout: k/v [layers, (num_pages + 1) * page_size, H_kv, D]. A slot holds one token per KV
head, and compaction may put different tokens in the same slot for different heads (slot j
of head h = the j-th kept token of head h), which this layout allows at no extra cost.
The last page is a scratch page that the allocator never hands out: page-table row
`scratch_row` (one past the sequences' rows) points only at it, so padded rows of a
fixed-shape (CUDA-graph) decode batch can write and attend somewhere harmless.
"""
from __future__ import annotations

import torch

from minisparse.config.schema import EngineConfig
from minisparse.engine.models import CausalLM
from minisparse.utils.kernels import triton_module

_GIB = 1 << 30


def pool_bytes(cfg: EngineConfig, device: torch.device, counted: int = 0) -> int:
    """Bytes for the pool: kv_memory_gb if set, else on CUDA kv_memory_fraction of the
    engine's rollout-time memory, minus `counted` bytes the engine already took from it
    (the fused weight copy, allocated just before): fraction * (free + counted) - counted,
    so the copy leaves the engine's total where it was without it. On CPU: a fraction of
    kv_cpu_memory_gb."""
    if cfg.kv_memory_gb > 0:
        return int(cfg.kv_memory_gb * _GIB)
    if device.type == "cuda":
        free = cuda_free(device)
        return max(0, int(cfg.kv_memory_fraction * (free + counted)) - counted)
    return int(cfg.kv_memory_fraction * cfg.kv_cpu_memory_gb * _GIB)


def cuda_free(device: torch.device) -> int:
    """Bytes this process may still allocate on the GPU: what is free, and no more than its
    per-process memory cap leaves (gpu_memory_gb sets one: trainer/memory/plan.py)."""
    if device.index is None:  # "cuda": the current device (torch wants an index below)
        device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    if fraction < 1.0:
        free = min(free, max(0, int(fraction * total) - torch.cuda.memory_reserved(device)))
    return free


class KVPool:
    def __init__(self, lm: CausalLM, cfg: EngineConfig, window: int, device: torch.device) -> None:
        """window: queries kept per sequence for compression (0: dense, no query ring)."""
        self.lm, self.cfg, self.device = lm, cfg, device
        self.page_size = cfg.page_size
        self.window = window
        self.max_model_len = cfg.context_len(lm.max_position)
        self.k = self.v = self.q_ring = self.page_table = None
        self.num_pages = 0

    @property
    def allocated(self) -> bool:
        return self.k is not None

    def bytes_per_page(self) -> int:
        elt = torch.empty((), dtype=self.lm.dtype).element_size()
        lm = self.lm
        return 2 * lm.num_layers * self.page_size * lm.num_kv_heads * lm.head_dim * elt

    def allocate(self) -> None:
        """Allocate ring and page table, then give the pool what the budget leaves."""
        lm, dev, dtype = self.lm, self.device, self.lm.dtype
        if self.window:
            rows = (self.cfg.max_num_seqs + 1) * self.window
            self.q_ring = torch.zeros(lm.num_layers, rows, lm.num_heads, lm.head_dim,
                                      dtype=dtype, device=dev)
        budget = pool_bytes(self.cfg, dev, self.lm.fused_bytes)  # pays for the fused copy
        self.num_pages = budget // self.bytes_per_page() - 1
        if self.num_pages < 1:
            raise RuntimeError("KV pool budget is smaller than two pages")
        pages_per_seq = min(self.num_pages, -(-self.max_model_len // self.page_size))
        self.page_table = torch.zeros(self.cfg.max_num_seqs + 1, pages_per_seq,
                                      dtype=torch.long, device=dev)
        self.page_table[self.scratch_row] = self.num_pages
        shape = (lm.num_layers, (self.num_pages + 1) * self.page_size, lm.num_kv_heads,
                 lm.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=dev)
        self.v = torch.zeros(shape, dtype=dtype, device=dev)

    def release(self) -> None:
        self.k = self.v = self.q_ring = self.page_table = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def scratch_row(self) -> int:
        return self.cfg.max_num_seqs

    @property
    def pages_per_seq(self) -> int:
        return self.page_table.shape[1]

    def set_rows(self, rows: list[int], tables: list[list[int]],
                 starts: list[int] | None = None) -> None:
        """Write sequences' page lists into the device page table (one copy per call):
        row rows[i] gets tables[i][starts[i]:] at columns starts[i]... (all of it when
        starts is None)."""
        starts = starts or [0] * len(rows)
        r = [row for row, t, s in zip(rows, tables, starts) for _ in range(s, len(t))]
        if not r:
            return
        c = [i for t, s in zip(tables, starts) for i in range(s, len(t))]
        p = [page for t, s in zip(tables, starts) for page in t[s:]]
        rcp = torch.tensor([r, c, p], dtype=torch.long).to(self.device, non_blocking=True)
        self.page_table[rcp[0], rcp[1]] = rcp[2]

    def copy_pages(self, copies: list[tuple[list[int], list[int]]]) -> None:
        """Copy whole pages, every layer's K and V: copies[i] = (from pages, to pages).
        Layer by layer, so the staging copy is one layer's share of the moved bytes."""
        src = [p for a, _ in copies for p in a]
        if not src:
            return
        dst = [p for _, b in copies for p in b]
        ps = self.page_size
        pages = torch.tensor([src, dst], dtype=torch.long).to(self.device, non_blocking=True)
        slots = (pages[:, :, None] * ps + torch.arange(ps, device=self.device)).flatten(1)
        for cache in (self.k, self.v):
            for layer in cache:
                layer[slots[1]] = layer[slots[0]]

    def slots(self, rows: torch.Tensor, length: int) -> torch.Tensor:
        """Pool slots of cache entries 0..length-1 for each row: [len(rows), length]."""
        j = torch.arange(length, device=self.device)
        pages = (j // self.page_size).clamp_(max=self.pages_per_seq - 1)
        return self.page_table[rows][:, pages] * self.page_size + j % self.page_size

    def slot_of(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Pool slot of cache entry index[i] of row rows[i]."""
        ps = self.page_size
        return self.page_table[rows, index // ps] * ps + index % ps

    def ring_queries(self, rows: torch.Tensor, next_pos: torch.Tensor) -> torch.Tensor:
        """The last W queries of each row in time order, laid out as scoring reads them:
        [len(rows), layers, H_q, W, D]. On CUDA one Triton kernel (triton_compaction),
        elsewhere _ring_queries, its reference."""
        fast = triton_module("minisparse.engine.triton_compaction", self.q_ring)
        if fast is not None:
            return fast.ring_queries(self.q_ring, self.window, rows, next_pos)
        return _ring_queries(self.q_ring, self.window, rows, next_pos)


def _ring_queries(q_ring: torch.Tensor, window: int, rows: torch.Tensor,
                  next_pos: torch.Tensor) -> torch.Tensor:
    """KVPool.ring_queries as one index_select of whole D-value rows (read as int64 words)
    straight into scoring's order: indexing the ring per element, then permuting, moved
    the data twice at a quarter of the copy bandwidth."""
    layers, ring_rows, h_q, d = q_ring.shape
    order = (next_pos[:, None] + torch.arange(window, device=q_ring.device)) % window
    flat = rows[:, None] * window + order  # [s, W], oldest first
    layer = torch.arange(layers, device=q_ring.device)[None, :, None, None]
    head = torch.arange(h_q, device=q_ring.device)[None, None, :, None]
    index = (layer * ring_rows + flat[:, None, None, :]) * h_q + head  # [s, L, H_q, W]
    out = word_rows(q_ring).index_select(0, index.reshape(-1))
    return out.view(q_ring.dtype).view(len(rows), layers, h_q, window, d)


def word_rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., D] as one row per D values, read as the widest integers that divide a row
    (int64 for 128 bf16 values: 4x fewer elements for the copy kernels to index)."""
    row = t.shape[-1] * t.element_size()
    for dtype in (torch.int64, torch.int32, torch.int16):
        if row % dtype.itemsize == 0 and t.element_size() <= dtype.itemsize:
            t = t.view(dtype)
            break
    return t.reshape(-1, t.shape[-1])
