"""Random paged-decode problems and a float64 per-token reference, shared by the CPU
(interpreter) and CUDA tests of paged decode attention."""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from triton_interpreter import import_interpreted


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    rows: torch.Tensor
    cache_lens: torch.Tensor
    page_size: int
    scale: float

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.page_table, self.rows,
                self.cache_lens, self.page_size, self.scale)


def make_case(lens: list[int], h_q: int, h_kv: int, D: int, page_size: int,
              dtype: torch.dtype, device: str = "cpu", seed: int = 0,
              poison: float = float("nan")) -> Case:
    """Sequences of the given cache lengths on shuffled, non-contiguous pages of a pool whose
    every other slot (page tails, spare pages, unused table entries) holds `poison`.
    Built on `device` without per-token host work, so it also makes benchmark-sized pools."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    need = torch.tensor([-(-n // page_size) for n in lens], dtype=torch.long)
    P = max(int(need.max()), 1) + 2  # table wider than any sequence needs
    num_pages = int(need.sum()) + 3  # spare pages stay poisoned
    perm = torch.randperm(num_pages, generator=g)
    R = B + 3
    rows = torch.randperm(R, generator=g)[:B]
    table = torch.full((R, P), int(perm[-1]), dtype=torch.long)  # unused -> a poisoned page
    col = torch.arange(P)
    owned = col[None, :] < need[:, None]  # [B, P]
    sub = table[rows]
    sub[owned] = perm[: int(need.sum())]
    table[rows] = sub
    lens_t = torch.tensor(lens, dtype=torch.long)
    j = torch.arange(max(max(lens), 1))
    valid = j[None, :] < lens_t[:, None]
    slots = (sub[:, (j // page_size).clamp(max=P - 1)] * page_size + j % page_size)[valid]
    dg = torch.Generator(device=device).manual_seed(seed)
    k = torch.full((num_pages * page_size, h_kv, D), poison, dtype=dtype, device=device)
    v = torch.full_like(k, poison)
    slots = slots.to(device)
    k[slots] = torch.randn(len(slots), h_kv, D, generator=dg, device=device).to(dtype)
    v[slots] = torch.randn(len(slots), h_kv, D, generator=dg, device=device).to(dtype)
    q = torch.randn(B, h_q, D, generator=dg, device=device).to(dtype)
    return Case(q, k, v, table.to(device), rows.to(device),
                lens_t.to(device, torch.int32), page_size, D ** -0.5)


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
