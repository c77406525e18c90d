"""The algebraic redundancy path: column sums against a brute-force L x L loop, the
last-above search, negative thresholds with padding, and the Triton kernels (compiled on
CUDA, Triton's CPU interpreter otherwise) against the PyTorch path."""
from __future__ import annotations

import pytest
import torch

from minisparse.compression.scoring import NORM_EPS, column_sums_torch, last_above

from . import reference
from .helpers import make_inputs, make_rule
from triton_interpreter import import_interpreted


def brute_sums(keys: torch.Tensor, length: int, threshold: float, dtype: torch.dtype):
    """[H, L] column sums straight from the rule on the input-dtype similarity matrix."""
    k = keys[:, :length].to(torch.promote_types(dtype, torch.float32))
    unit = (k / (k.norm(dim=-1, keepdim=True) + NORM_EPS)).to(dtype)
    sim = (unit @ unit.transpose(-1, -2)).double()
    for h in range(sim.shape[0]):
        sim[h].fill_diagonal_(0.0)
        for i in range(length):
            above = (sim[h, i] > threshold).nonzero()
            sim[h, i, int(above.max()) if len(above) else 0] = 0.0
    return sim.sum(dim=-2)


def padded(lengths, h_kv=2, dim=16, fill=float("nan"), dtype=torch.float32, seed=0):
    lmax = max(lengths) + 5
    keys = torch.full((len(lengths), h_kv, lmax, dim), fill, dtype=dtype)
    for b, n in enumerate(lengths):
        keys[b, :, :n] = make_inputs(h_kv, 1, n, 4, dim=dim, seed=seed + b, dtype=dtype)[0]
    return keys, torch.tensor(lengths)


@pytest.mark.parametrize("threshold", [0.5, -0.3, 0.999])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_sums_match_brute_force(threshold, dtype):
    lengths = [1, 7, 40, 33]
    keys, lens = padded(lengths, dtype=dtype)
    sums = column_sums_torch(keys, lens, threshold)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(sums[b, :, :n].double(),
                                   brute_sums(keys[b], n, threshold, dtype),
                                   rtol=1e-5, atol=1e-5)
        assert (sums[b, :, n:] == 0).all()


# last_above multiplies against the reversed rows, the reference against the rows in
# order: the same float64 dot products of 8-dim unit vectors summed in another order, so
# they agree to a few ulps of 1 (|error| <= 8 * 2**-53 ~ 1e-15), not bit for bit, and can
# differ between CPUs' BLAS kernels. 1e-12 leaves a wide margin and is still far below
# any real gap between similarities (a wrong pick would be off by ~1e-1).
SIM_TOL = 1e-12


def test_last_above_finds_the_last():
    unit = torch.nn.functional.normalize(torch.randn(2, 3, 20, 8, dtype=torch.float64), dim=-1)
    lengths = torch.tensor([20, 13])
    unit[1, :, 13:] = 0.0
    threshold = 0.2
    last, value = last_above(unit, lengths, threshold)
    sim = unit @ unit.transpose(-1, -2)
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    for b, n in enumerate(lengths.tolist()):
        for h in range(3):
            for i in range(n):
                row = sim[b, h, i, :n]
                # Similarities within SIM_TOL of the threshold may land on either side
                # of it in last_above's own arithmetic: after the last clearly-above one,
                # any such borderline index is a correct answer too.
                clear = (row > threshold + SIM_TOL).nonzero()
                j = int(clear.max()) if len(clear) else 0
                borderline = ((row - threshold).abs() <= SIM_TOL).nonzero().flatten()
                allowed = {j} | {int(k) for k in borderline if k > j}
                if not len(clear):
                    allowed |= {0}
                got = int(last[b, h, i])
                assert got in allowed, (b, h, i, got, allowed)
                assert abs(float(value[b, h, i]) - float(row[got])) <= SIM_TOL


@pytest.mark.parametrize("threshold", [-0.3, 0.5])
def test_batch_with_padding_any_threshold(threshold):
    """Padding must not count as 'above' even when the threshold is negative."""
    lengths = [30, 57, 41]
    keys, lens = padded(lengths, fill=0.0)
    queries = torch.randn(len(lengths), 4, 4, 16, generator=torch.Generator().manual_seed(1))
    rule = make_rule("rkv", budget=24, window=4, pooling="avg", sim_threshold=threshold)
    kept = rule.select_batch(keys, queries, lens)
    for b, n in enumerate(lengths):
        ref = reference.scores(keys[b, :, :n], queries[b], "rkv", pooling="avg",
                               sim_threshold=threshold)
        reference.check_selection(kept[b], ref, n, 24, 4, "per_head", 1e-6)


# ---- Triton kernels ---------------------------------------------------------------------

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tr():
    """triton_redundancy: compiled on CUDA, else run by Triton's CPU interpreter (its
    modules re-imported so that @jit picks the interpreter; the compiled triton._C stays)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        from minisparse.compression import triton_redundancy

        return triton_redundancy
    return import_interpreted("minisparse.compression.triton_redundancy")


TRITON_CASES = [(torch.float32, 0.5), (torch.float32, -0.3), (torch.float32, 0.999),
                (torch.bfloat16, 0.5), (torch.float16, 0.5), (torch.bfloat16, -0.3)]


@pytest.mark.parametrize("dtype,threshold", TRITON_CASES)
def test_triton_matches_torch(tr, dtype, threshold):
    # Lengths on and across the 64-token blocks; one row of a single token.
    lengths = [1, 64, 65, 130, 97]
    keys, lens = padded(lengths, dim=24, dtype=dtype, seed=7)  # D=24: padded to 32 lanes
    keys, lens = keys.to(DEV), lens.to(DEV)
    fast = tr.column_sums(keys, lens, threshold, NORM_EPS).cpu()
    slow = column_sums_torch(keys.cpu(), lens.cpu(), threshold).float()
    # The interpreter rounds exactly as the PyTorch path: equal up to float32 sums. On a
    # GPU, tensor cores sum in another order, so a half-precision similarity on the
    # threshold may round the other way; such a flip moves one entry (<= 1) of a column.
    close = (fast - slow).abs() <= 1e-3 + 1e-4 * slow.abs()
    exact = dtype == torch.float32 or DEV == "cpu"
    assert close.float().mean() >= (1.0 if exact else 0.99), (
        float((fast - slow).abs().max()))
    for b, n in enumerate(lengths):
        assert (fast[b, :, n:] == 0).all()
