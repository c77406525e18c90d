"""engine.triton_compaction under Triton's interpreter against the PyTorch copies it
replaces: the key gather and the ring queries scoring reads, and the in-place packing of
the kept entries.
test_gpu_kernels.py runs the same checks compiled, at the 3B head size."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minisparse.engine import compaction
from minisparse.engine import kv_pool
from triton_interpreter import import_interpreted

LAYERS, H, PS = 3, 2, 4


@pytest.fixture(scope="module")
def tc():
    return import_interpreted("minisparse.engine.triton_compaction")


def _pool(device: str = "cpu", d: int = 16, seed: int = 0, num_pages: int = 128,
          seqs: int = 5, pages_each: int = 24):
    """A pool with random contents whose sequences own shuffled, disjoint pages."""
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, (num_pages + 1) * PS, H, d)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    pages = torch.randperm(num_pages, generator=g)[:seqs * pages_each].view(seqs, pages_each)
    table = torch.zeros(seqs + 1, pages_each + 2, dtype=torch.long)
    table[:seqs, :pages_each] = pages
    pool = SimpleNamespace(k=k.to(device), v=v.to(device), page_table=table.to(device),
                           page_size=PS, device=torch.device(device))
    pool.slot_of = lambda rows, index: pool.page_table[rows, index // PS] * PS + index % PS
    return pool


def check_gather(tc, device: str, d: int) -> None:
    pool = _pool(device, d)
    rows = torch.tensor([3, 0, 4], device=device)
    lens = torch.tensor([45, 37, 48], device=device)
    got = tc.gather_keys(pool.k, pool.page_table, PS, rows, lens, 48)
    want = compaction._gather_keys(pool, rows, 48)
    assert got.shape == want.shape == (3, LAYERS, H, 48, d)
    for i, n in enumerate(lens.tolist()):
        assert torch.equal(got[i, :, :, :n], want[i, :, :, :n])
        assert not got[i, :, :, n:].any()  # zeros past the sequence's length


def check_ring(tc, device: str, d: int, window: int = 6, h_q: int = 6) -> None:
    """The kernel's queries equal KVPool's index_select, for a window that is no power
    of two and rings whose oldest slot is anywhere (first, middle, last)."""
    g = torch.Generator().manual_seed(window)
    q_ring = torch.randn(LAYERS, 7 * window, h_q, d, generator=g).to(device)
    rows, next_pos = torch.tensor([3, 0, 6, 5], device=device), torch.tensor([0, 2, 5, 11],
                                                                            device=device)
    want = kv_pool._ring_queries(q_ring, window, rows, next_pos)
    got = tc.ring_queries(q_ring, window, rows, next_pos)
    assert got.shape == want.shape == (4, LAYERS, h_q, window, d)
    assert torch.equal(got, want)


def check_compact(tc, device: str, d: int, budget: int, L: int,
                  protected: tuple[int, ...] | None = None) -> None:
    """Each head keeps its own ascending entries; the kernel packs them in place block by
    block and must end where the PyTorch gather-then-scatter ends, everywhere in the pool.
    protected: each sequence's leading entries that stay (keep_prompt), the kept ones
    packed after them."""
    pool = _pool(device, d, seed=budget)
    rows = torch.tensor([1, 4, 2], device=device)
    first = protected or (0, 0, 0)
    g = torch.Generator().manual_seed(budget)
    keep = torch.stack([p + torch.randperm(L - p, generator=g)[:budget].sort().values
                        for p in first for _ in range(LAYERS * H)]).view(3, LAYERS, H, budget)
    keep[0, 0, 0] = first[0] + torch.arange(budget)  # nothing moves
    keep[1, 1, 1] = torch.arange(L - budget, L)  # everything moves by the same shift
    keep = keep.to(device)
    first = None if protected is None else torch.tensor(first, device=device)
    want = SimpleNamespace(**vars(pool))
    want.k, want.v = pool.k.clone(), pool.v.clone()
    compaction._pack(want, rows, keep, first)
    assert not torch.equal(want.k, pool.k)
    before = pool.k.clone()
    tc.compact_in_place(pool.k, pool.v, pool.page_table, PS, rows, keep, first)
    assert torch.equal(pool.k, want.k) and torch.equal(pool.v, want.v)
    if protected is not None:  # the protected entries are where they were
        for i, p in enumerate(protected):
            slots = pool.slot_of(rows[i:i + 1, None], torch.arange(p, device=device)[None])[0]
            assert torch.equal(pool.k[:, slots], before[:, slots])


def test_gather_keys_matches_index_select(tc):
    check_gather(tc, "cpu", 16)


@pytest.mark.parametrize("window", [6, 8])
def test_ring_queries_match_index_select(tc, window):
    check_ring(tc, "cpu", 16, window)


@pytest.mark.parametrize("budget,L", [(40, 47), (70, 90)])  # 2 or 3 blocks of 32, a tail
def test_compact_in_place_matches_gather_then_copy(tc, budget, L):
    check_compact(tc, "cpu", 16, budget, L)


def test_compact_in_place_after_protected_prompts(tc):
    """keep_prompt: entries below each sequence's own prompt length stay, the kept ones
    land right after them (a prompt that ends inside a page, one on a page boundary)."""
    check_compact(tc, "cpu", 16, 40, 90, protected=(5, 8, 13))


def test_rejects_non_contiguous_cache(tc):
    pool = _pool()
    with pytest.raises(ValueError, match="contiguous"):
        tc.gather_keys(pool.k.transpose(2, 3), pool.page_table, PS, torch.tensor([0]),
                       torch.tensor([8]), 8)
    with pytest.raises(ValueError, match="q_ring must be contiguous"):
        tc.ring_queries(pool.k.transpose(2, 3), 4, torch.tensor([0]), torch.tensor([1]))
