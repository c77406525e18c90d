"""Random paged-decode problems and a float64 per-token reference, shared by the CPU
(interpreter) and CUDA tests of paged decode attention."""
from __future__ import annotations

from types import ModuleType

import torch
from triton_interpreter import import_interpreted

from minisparse.bench.decode import Case, make_case  # noqa: F401  (moved there)


def naive_reference(c: Case) -> torch.Tensor:
    """Float64, one sequence and head at a time, slots walked entry by entry."""
    B, h_q, D = c.q.shape
    h_kv = c.k_cache.shape[1]
    G = h_q // h_kv
    table, rows = c.page_table.cpu(), c.rows.cpu()
    k, v, q = c.k_cache.cpu().double(), c.v_cache.cpu().double(), c.q.cpu().double()
    out = torch.zeros(B, h_q, D, dtype=torch.float64)
    for b, n in enumerate(c.cache_lens.tolist()):
        if n == 0:
            continue
        slots = [int(table[rows[b], j // c.page_size]) * c.page_size + j % c.page_size
                 for j in range(n)]
        for h in range(h_q):
            kh, vh = k[slots, h // G], v[slots, h // G]
            p = torch.softmax(kh @ q[b, h] * c.scale, dim=0)
            out[b, h] = p @ vh
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.detach().cpu().double()
    ref = ref.detach().cpu().double()
    return float((out - ref).norm() / ref.norm())


def interpreted_triton_decode() -> ModuleType:
    """triton_decode run by the CPU interpreter; only for machines without CUDA, where
    nothing could run compiled anyway."""
    return import_interpreted("minisparse.engine.layers.triton_decode")
