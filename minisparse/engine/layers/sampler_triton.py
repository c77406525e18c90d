"""Fused sampling: temperature, truncation, the seeded exponential race and the sampled
token's log-prob in one pass over the LM head's output, as a Triton kernel.

Why: the PyTorch sampler (layers/sampler.py, kept as the reference and the CPU path) makes
~20 elementwise passes over the float32 [B, vocab] logits (hash, noise, exp, division,
logsumexp...), a quarter of a decode step at batch 256. Here each program reads one chunk
of a row once, in the head's own dtype (no float32 copy of the logits), and keeps
  - the online max and sum of exp(scaled) (for the log-sum-exp, over the whole row),
  - the race winner: argmax of scaled - log(E) over the tokens kept by truncation, with
    E = -log(u) and u the same counter hash of (seed, step, vocab id) as the reference
    (log of the reference's p / E, so the same law; rounding can break near-ties apart;
    the column half of the hash comes from the reference's cached per-column table),
  - the winner's scaled logit (its log-prob numerator), read back once at the end.
The work per column (hash, two logs, exp) makes this compute bound, not memory bound:
the outer log runs on the GPU's fast lg2 (_log_e) and the next columns load while the
current ones are computed (127 -> 94 us at 256 x 151,936 on an H200).
A second, tiny kernel merges the chunks. Ties go to the lowest vocab id (as torch.argmax).
Temperature 0 is greedy with the T = 1 log-prob, as in the reference.

Truncation (top-k / top-p) arrives as one raw-logit threshold per row, from a PyTorch
sort/top-k pass that runs only when truncation is on: a token is kept iff its logit is at
least the threshold (the reference's kept set, plus any tokens tied with its last one);
the sum of exp then runs over the kept tokens alone, so the log-prob is the truncated,
renormalised distribution's, as in the reference.
Everything is shape-static and sync-free, so it is captured inside the decode CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from minisparse.engine.layers.sampler import column_hashes, truncate

_CHUNK = 8192  # vocab columns per program
_BLOCK = 1024


@triton.jit
def _fmix32(x):
    """murmur3 fmix32 on uint32 (wrapping multiplies, logical shifts)."""
    x ^= x >> 16
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    x ^= x >> 16
    return x


@triton.jit
def _log_e(e, FAST: tl.constexpr):
    """log(E) for the race key. On CUDA the MUFU lg2 (about 2^-22 relative error, so
    keys move by ~1e-6 at most: only a near-tie that close can flip) instead of libdevice's
    logf polynomial; the inner -log(u) stays exact, since u near 1 (the winners of flat
    rows) needs its absolute error small. FAST is off under the interpreter."""
    if FAST:
        return libdevice.fast_logf(e)
    return tl.log(e)


@triton.jit
def _partial_kernel(LOGITS, COL_HASH, SEEDS, STEPS, THRESH, M_OUT, L_OUT, K_OUT, I_OUT, S_OUT,
                    V, stride_row, inv_t, chunk,
                    NSPLIT: tl.constexpr, GREEDY: tl.constexpr, HAS_THRESH: tl.constexpr,
                    BLOCK: tl.constexpr, FAST: tl.constexpr):
    b = tl.program_id(0)
    sp = tl.program_id(1)
    row_ptr = LOGITS + b.to(tl.int64) * stride_row
    if not GREEDY:  # row hash of (seed, step), as sampler.row_hashes
        seed = tl.load(SEEDS + b).to(tl.uint32)
        step = tl.load(STEPS + b).to(tl.uint32)
        rh = _fmix32(_fmix32(seed) ^ (step * 0x2545F491 + 0x9E3779B9))
    if HAS_THRESH:
        thresh = tl.load(THRESH + b)
    # Per lane (one column of the BLOCK-wide loads) across the blocks: the sum of
    # exp(scaled - m) and the race's best key and its column (the first one reaching it:
    # columns grow); reduced over lanes once, after the loop, rather than ~5 block
    # reductions per load. The next block's logits and column hashes are loaded before
    # the current block is computed (plain loads are not pipelined by Triton; the loop
    # was latency bound).
    m = -float("inf")
    l_vec = tl.zeros([BLOCK], tl.float32)
    k_vec = tl.full([BLOCK], -float("inf"), tl.float32)
    i_vec = tl.zeros([BLOCK], tl.int32)
    start = sp * chunk
    end = tl.minimum(start + chunk, V)
    lane = tl.arange(0, BLOCK)
    x_next = tl.load(row_ptr + start + lane, mask=start + lane < end, other=-float("inf"))
    if not GREEDY:
        ch_next = tl.load(COL_HASH + start + lane, mask=start + lane < end, other=0)
    for c0 in range(start, end, BLOCK):
        cols = c0 + lane
        valid = cols < end
        x = x_next.to(tl.float32)
        ahead = cols + BLOCK
        x_next = tl.load(row_ptr + ahead, mask=ahead < end, other=-float("inf"))
        s = x * inv_t
        m_new = tl.maximum(m, tl.max(s, 0))
        e_s = tl.exp(s - m_new)
        if HAS_THRESH:  # the log-sum-exp of the distribution sampled: kept tokens only
            e_s = tl.where(x >= thresh, e_s, 0.0)
        l_vec = l_vec * tl.exp(m - m_new) + e_s
        m = m_new
        if GREEDY:
            key = s
        else:
            # the per-column hash is the same for every row: read from the reference's
            # cached table (L2-resident) instead of two more fmix32 per element
            ch = ch_next.to(tl.uint32, bitcast=True)
            ch_next = tl.load(COL_HASH + ahead, mask=ahead < end, other=0)
            bits = _fmix32(rh ^ ch)
            u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            key = s - _log_e(-tl.log(u), FAST)
            key = tl.where(valid, key, -float("inf"))
        if HAS_THRESH:
            key = tl.where(x >= thresh, key, -float("inf"))
        better = key > k_vec
        k_vec = tl.where(better, key, k_vec)
        i_vec = tl.where(better, cols, i_vec)
    l = tl.sum(tl.where(l_vec > 0, l_vec, 0.0), 0)
    best_k = tl.max(k_vec, 0)
    # lowest column among the lanes at the best key (ties go to the lowest vocab id);
    # no lane improved on -inf: column `start`, as the block-wise version gave
    best_i = tl.min(tl.where(k_vec == best_k, i_vec, end), 0)
    best_i = tl.where(best_k > -float("inf"), best_i, start)
    best_s = tl.load(row_ptr + best_i).to(tl.float32) * inv_t  # the winner's scaled logit
    o = b * NSPLIT + sp
    tl.store(M_OUT + o, m)
    tl.store(L_OUT + o, l)
    tl.store(K_OUT + o, best_k)
    tl.store(I_OUT + o, best_i)
    tl.store(S_OUT + o, best_s)


@triton.jit
def _merge_kernel(M_IN, L_IN, K_IN, I_IN, S_IN, TOKENS, LOGPROBS,
                  NSPLIT: tl.constexpr, S_PAD: tl.constexpr):
    b = tl.program_id(0)
    sp = tl.arange(0, S_PAD)
    ok = sp < NSPLIT
    base = b * NSPLIT + sp
    m = tl.load(M_IN + base, mask=ok, other=-float("inf"))
    l = tl.load(L_IN + base, mask=ok, other=0.0)
    k = tl.load(K_IN + base, mask=ok, other=-float("inf"))
    top = tl.max(m, 0)
    lse = top + tl.log(tl.sum(tl.where(l > 0, l * tl.exp(m - top), 0.0), 0))
    win = tl.argmax(k, 0)  # first split on ties: lowest vocab id
    i = tl.load(I_IN + b * NSPLIT + win)
    s = tl.load(S_IN + b * NSPLIT + win)
    tl.store(TOKENS + b, i.to(tl.int64))
    tl.store(LOGPROBS + b, s - lse)


def truncation_threshold(logits: torch.Tensor, temperature: float, top_k: int,
                         top_p: float) -> torch.Tensor | None:
    """Per-row raw-logit threshold [B] float32 of the reference's top-k / top-p set (None
    when truncation is off): the smallest logit that `truncate` keeps."""
    V = logits.shape[-1]
    if not (0 < top_k < V or top_p < 1.0):
        return None
    x = logits.float()
    scaled = x if temperature in (0, 1) else x / temperature
    kept = truncate(scaled, top_k, top_p)  # -inf where dropped
    return torch.where(kept > -float("inf"), x, float("inf")).amin(-1)


def fused_sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                 seeds: torch.Tensor, steps: torch.Tensor, *, chunk: int = _CHUNK,
                 block: int = _BLOCK, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype, unit stride in V); seeds/steps [B] integers. Returns
    (tokens [B] int64, logprobs [B] float32) with sampler.sample's contract. No host sync.
    chunk / block / num_warps (vocab columns per program / per load, warps) are exposed for
    tests and sweeps; the defaults were the fastest of 4k-32k / 512-2k / 4-8 on an H200."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] with unit stride in V, got "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    if seeds.shape != (logits.shape[0],) or steps.shape != seeds.shape:
        raise ValueError(f"seeds {tuple(seeds.shape)} / steps {tuple(steps.shape)} must be "
                         f"[{logits.shape[0]}]")
    B, V = logits.shape
    dev = logits.device
    greedy = temperature == 0
    inv_t = 1.0 if temperature in (0, 1) else 1.0 / temperature
    thresh = None if greedy else truncation_threshold(logits, temperature, top_k, top_p)
    if block & (block - 1) or chunk % block:
        raise ValueError(f"block must be a power of two dividing chunk, got {block}, {chunk}")
    nsplit = triton.cdiv(V, chunk)
    parts = [torch.empty(B, nsplit, dtype=torch.float32, device=dev) for _ in range(4)]
    m, l, k, s = parts
    i = torch.empty(B, nsplit, dtype=torch.int32, device=dev)
    tokens = torch.empty(B, dtype=torch.int64, device=dev)
    logprobs = torch.empty(B, dtype=torch.float32, device=dev)
    if B == 0:
        return tokens, logprobs
    _partial_kernel[(B, nsplit)](
        logits, column_hashes(V, dev), seeds, steps, thresh if thresh is not None else m,
        m, l, k, i, s, V, logits.stride(0), inv_t, chunk,
        NSPLIT=nsplit, GREEDY=greedy, HAS_THRESH=thresh is not None, BLOCK=block,
        FAST=logits.is_cuda, num_warps=num_warps)
    _merge_kernel[(B,)](m, l, k, i, s, tokens, logprobs, NSPLIT=nsplit,
                        S_PAD=max(2, triton.next_power_of_2(nsplit)), num_warps=1)
    return tokens, logprobs
