"""Triton paged decode attention: one query token per sequence against its paged KV cache.

Why a kernel: the PyTorch path gathers every cached K/V byte into a dense [B, H_kv, L, D]
copy and reads it again in SDPA; decode is memory bound, so reading the pool once in place
halves the traffic. Each program owns one (sequence, KV head, split): it loads a [BLOCK_N, D]
tile of K and V once (slots looked up per token through the page table, so BLOCK_N does not
depend on page_size) and serves all G query heads of that KV head with one tl.dot against a
[G_PAD, D] query tile (G padded to 16, the smallest MMA M; the padded rows are free because
the kernel is bound by the K/V loads, not by the MMA). When B * H_kv programs cannot fill the
GPU, the sequence axis is split (flash-decoding), and the last split of a (sequence, KV
head) to finish merges the partial results through their log-sum-exps (a per-pair counter;
no second launch: 1-3% faster than a merge kernel on an H200 where splits run). Softmax
runs in fp32 in base 2. rope_decode_attention is the same kernel taking the step's fused
qkv projection instead of rotated queries: it applies RoPE itself and writes the new K/V
(and the compression query ring), which saves the separate RoPE launch per layer of a
decode step. fp32 inputs use exact (non-TF32) dots; so do CPU tensors, i.e. Triton's
interpreter, whose bf16/fp16 tl.dot returns garbage in Triton 3.6.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisparse.engine.layers.fused_ops import num_sms, rotate_rows

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64
_MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost outweighs the extra parallelism


@triton.jit
def _split_kernel(Q, K, V, PT, ROWS, LENS, OUT, MID_O, MID_LSE, COUNT, qk_scale, split_len,
                  stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pt,
                  stride_ob, stride_oh, stride_mb, stride_mh, stride_ms,
                  COS, SIN, SLOTS, RING, RING_ROWS,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_N: tl.constexpr, SINGLE: tl.constexpr, IEEE: tl.constexpr,
                  ROPE: tl.constexpr, HKV: tl.constexpr, HAS_RING: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr):
    """ROPE: Q is the fused qkv projection (row stride stride_qb); this program rotates its
    query heads itself, and the split holding the new token (entry length - 1, not in the
    cache yet) rotates its key, writes key and value to SLOTS[b] (and the queries to the
    ring row RING_ROWS[b] when >= 0), and attends to it from registers after the cached
    entries. The KV heads are the grid's first axis, so a sequence's heads run side by
    side and read whole slot rows together (0.4-1% faster on an H200 in 7 of 9 shapes)."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    s = tl.program_id(2)
    row = tl.load(ROWS + b).to(tl.int64)
    length = tl.load(LENS + b)
    start = s * split_len
    end = tl.minimum(start + split_len, length)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = h * G + g
    gmask = (g < G)[:, None]
    DT = OUT.dtype.element_ty
    qbase = Q + b.to(tl.int64) * stride_qb
    if ROPE:
        cos = tl.load(COS + b.to(tl.int64) * D + d).to(tl.float32)
        sin = tl.load(SIN + b.to(tl.int64) * D + d).to(tl.float32)
        q = rotate_rows(qbase, heads, d, cos, sin, gmask, D, DT)
        last = length - 1
        cached_end = tl.minimum(end, last)
    else:
        q = tl.load(qbase + heads[:, None] * stride_qh + d[None, :], mask=gmask, other=0.0)
        cached_end = end
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.full([G_PAD], 0.0, tl.float32)
    acc = tl.full([G_PAD, D], 0.0, tl.float32)
    pt_row = PT + row * stride_pt
    for n0 in range(start, cached_end, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        valid = j < cached_end
        page = tl.load(pt_row + j // PAGE, mask=valid, other=0).to(tl.int64)
        slot = page * PAGE + j % PAGE
        k = tl.load(K + slot[:, None] * stride_ks + h * stride_kh + d[None, :],
                    mask=valid[:, None], other=0.0)
        if IEEE:
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_vs + h * stride_vh + d[None, :],
                    mask=valid[:, None], other=0.0)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    if ROPE:
        if (start <= last) & (last < end):
            one = tl.arange(0, 1)
            k_new = rotate_rows(qbase, G * HKV + h + one, d, cos, sin, one[:, None] >= 0, D, DT)
            v_new = tl.load(qbase + (G * HKV + HKV + h + one)[:, None] * D + d[None, :])
            slot = tl.load(SLOTS + b).to(tl.int64)
            tl.store(K + slot * stride_ks + h * stride_kh + one[:, None] * 0 + d[None, :], k_new)
            tl.store(V + slot * stride_vs + h * stride_vh + one[:, None] * 0 + d[None, :], v_new)
            if HAS_RING:
                ring_row = tl.load(RING_ROWS + b)
                if ring_row >= 0:
                    tl.store(RING + ring_row * (G * HKV * D) + heads[:, None] * D + d[None, :],
                             q, mask=gmask)
            qk = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * qk_scale  # [G_PAD]
            m_new = tl.maximum(m, qk)
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(qk - m_new)
            l = l * alpha + p
            if not IEEE:
                p = p.to(DT).to(tl.float32)  # as the dot rounds p to the cache dtype
            acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)
            m = m_new

    nonempty = l > 0
    o = acc / tl.where(nonempty, l, 1.0)[:, None]  # empty split or length 0 -> zeros
    if SINGLE:
        ptr = OUT + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(ptr, o.to(OUT.dtype.element_ty), mask=gmask)
    else:
        base = b.to(tl.int64) * stride_mb + heads * stride_mh + s * stride_ms
        tl.store(MID_O + base[:, None] * D + d[None, :], o, mask=gmask)
        lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), float("-inf"))
        tl.store(MID_LSE + base, lse, mask=g < G)
        # The last split of this (sequence, KV head) to finish merges all of them: no
        # second launch. The barrier orders every thread's stores before the counter's
        # release; the acquire makes the other splits' stores visible to this program.
        tl.debug_barrier()
        cnt = COUNT + b.to(tl.int64) * HKV + h
        if tl.atomic_add(cnt, 1, sem="acq_rel") == NUM_SPLITS - 1:
            _merge_splits(MID_O, MID_LSE, OUT, b.to(tl.int64) * stride_mb + heads * stride_mh,
                          stride_ms, b.to(tl.int64) * stride_ob + heads * stride_oh, g < G,
                          NUM_SPLITS, S_PAD, D)
            tl.store(cnt, 0)  # ready for the next launch (a CUDA graph's next replay)


@triton.jit
def _merge_splits(MID_O, MID_LSE, OUT, base, stride_ms, out_off, hmask, NUM_SPLITS: tl.constexpr,
                  S_PAD: tl.constexpr, D: tl.constexpr):
    """out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M) for the heads at base (offsets
    of split 0): exact softmax over all splits. Loads bypass L1 (.cg): other programs
    wrote these partials."""
    sp = tl.arange(0, S_PAD)
    d = tl.arange(0, D)
    lse = tl.load(MID_LSE + base[None, :] + sp[:, None] * stride_ms,
                  mask=(sp < NUM_SPLITS)[:, None] & hmask[None, :], other=float("-inf"),
                  cache_modifier=".cg")
    top = tl.max(lse, 0)
    top = tl.where(top > float("-inf"), top, 0.0)
    res = tl.zeros([base.shape[0], D], tl.float32)
    total = tl.zeros([base.shape[0]], tl.float32)
    for t in tl.static_range(NUM_SPLITS):
        off = base + t * stride_ms
        w = tl.exp2(tl.load(MID_LSE + off, mask=hmask, other=float("-inf"),
                            cache_modifier=".cg") - top)  # empty splits weigh 0
        o = tl.load(MID_O + off[:, None] * D + d[None, :], mask=(w > 0)[:, None], other=0.0,
                    cache_modifier=".cg")
        res += o * w[:, None]
        total += w
    res = res / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(OUT + out_off[:, None] + d[None, :], res.to(OUT.dtype.element_ty),
             mask=hmask[:, None])


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 counter per (sequence, KV head) for the last-split merge, shared by
    every launch on the device (each merge resets its own to 0). A larger need gets a new
    buffer; the old ones stay alive for the CUDA graphs that captured them."""
    bufs = _COUNTERS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 1024), dtype=torch.int32, device=device))
    return bufs[-1]


def choose_splits(batch_heads: int, max_len: int, num_sms: int) -> int:
    """Enough splits for ~2 waves of programs over the SMs, none shorter than 256 tokens."""
    want = -(-2 * num_sms // max(batch_heads, 1))
    cap = max(1, -(-max_len // _MIN_SPLIT_TOKENS))
    return max(1, min(want, cap, _MAX_SPLITS))


def pipeline_stages(num_splits: int) -> int:
    """Triton's num_stages for the kernel. Triton 3.6 gives the page-id load a stage of
    its own, so K and V get a second shared-memory buffer (the next tile's copy in flight
    while this one is computed) only from 5 stages on; 2-4 all single-buffer them.
    Double buffering costs shared memory (72 KB per program at block_n 64: 3 programs per
    SM instead of 4), which loses where the grid fills the GPU without splits (256 x 600:
    46.0 -> 60.7 us; 256 x 4,096: 267 -> 321 us) and wins where the sequence axis is split
    because the batch is small (64 x 4,096: 79.1 -> 73.9 us; 16 x 4,096: 30.8 -> 26.0 us;
    H200, CUDA-graph replays)."""
    return 2 if num_splits == 1 else 5


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, rows: torch.Tensor,
                           cache_lens: torch.Tensor, page_size: int, scale: float, *,
                           max_len: int | None = None, num_splits: int | None = None,
                           block_n: int = 64, num_warps: int = 4,
                           num_stages: int | None = None) -> torch.Tensor:
    """q [B, H_q, D]; k/v_cache [S, H_kv, D]; page_table [R, P]; rows [B]; cache_lens [B]
    (valid entries, including the token just written). Returns [B, H_q, D] in q's dtype.

    max_len: max(cache_lens) or any upper bound, known on the host (else read with a device
    sync); entries past num_splits * split_len >= max_len are never visited, so it must not
    be smaller. num_splits overrides the heuristic (tests force split-K). block_n,
    num_warps, num_stages: the tiling; block_n 64 and 4 warps were the fastest (within 2%)
    of 32-128 / 2-8 on an H200 at B = 256 and 1,024, L = 600-4,096; num_stages: see
    pipeline_stages."""
    B, h_q, D = q.shape
    _check(h_q, D, k_cache, v_cache, page_size, block_n)
    q = q if q.stride(2) == 1 else q.contiguous()
    out = torch.empty_like(q)
    return _launch(q, q.stride(0), q.stride(1), out, k_cache, v_cache, page_table, rows,
                   cache_lens, page_size, scale, max_len, num_splits, block_n, num_warps,
                   num_stages)


def rope_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          page_table: torch.Tensor, rows: torch.Tensor,
                          cache_lens: torch.Tensor, page_size: int, scale: float,
                          num_heads: int, ring: torch.Tensor | None = None,
                          ring_rows: torch.Tensor | None = None, *,
                          max_len: int | None = None, num_splits: int | None = None,
                          block_n: int = 64, num_warps: int = 4,
                          num_stages: int | None = None) -> torch.Tensor:
    """One decode step's RoPE, K/V cache write, query-ring write and attention in one
    kernel: fused_ops.rope_and_cache followed by paged_decode_attention, for qkv [B,
    (H_q + 2 H_kv) D] (the fused projection, one new token per sequence) whose new token
    is entry cache_lens[b] - 1, stored at slots[b]. cos/sin [B, 1, D]; ring/ring_rows as
    for rope_and_cache. Returns the attention output [B, H_q, D].

    Why: the separate RoPE kernel was one more launch per layer and a round trip of the
    queries; here each (sequence, KV head) program rotates its own queries, and the one
    holding the new entry writes it and attends to it from registers."""
    B = qkv.shape[0]
    _, h_kv, D = k_cache.shape
    _check(num_heads, D, k_cache, v_cache, page_size, block_n)
    if qkv.shape[1] != (num_heads + 2 * h_kv) * D or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [B, (H_q + 2 H_kv) D] = "
                         f"[B, {(num_heads + 2 * h_kv) * D}] contiguous in its rows")
    if ring is not None and not ring.is_contiguous():
        raise ValueError("ring: must be contiguous [rows, H_q, D]")
    out = torch.empty(B, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    rope = (cos.contiguous(), sin.contiguous(), slots, ring, ring_rows)
    return _launch(qkv, qkv.stride(0), D, out, k_cache, v_cache, page_table, rows, cache_lens,
                   page_size, scale, max_len, num_splits, block_n, num_warps, num_stages, rope)


def _check(h_q: int, D: int, k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int,
           block_n: int) -> None:
    _, h_kv, Dk = k_cache.shape
    if h_q % h_kv or Dk != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"bad shapes: {h_q} query heads of dim {D}, k {tuple(k_cache.shape)} "
                         f"v {tuple(v_cache.shape)}")
    if D & (D - 1) or D < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {D}")
    if page_size < 1 or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"need page_size >= 1 and block_n a power of two >= 16, got "
                         f"{page_size}, {block_n}")
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("k_cache/v_cache must be contiguous in the head dim")


def _launch(q, stride_qb, stride_qh, out, k_cache, v_cache, page_table, rows, cache_lens,
            page_size, scale, max_len, num_splits, block_n, num_warps, num_stages,
            rope=None) -> torch.Tensor:
    """The split kernel (which merges its splits itself) over q (or qkv, with rope = (cos,
    sin, slots, ring, ring_rows))."""
    B, (h_q, D), h_kv = out.shape[0], out.shape[1:], k_cache.shape[1]
    if B == 0:
        return out
    if B > 65535:  # the grid's second axis
        raise ValueError(f"decode attention takes at most 65,535 sequences per call, got {B}")
    if max_len is None:
        max_len = int(cache_lens.max())
    if num_splits is None:
        num_splits = choose_splits(B * h_kv, max_len, num_sms(q.device))
    if num_stages is None:
        num_stages = pipeline_stages(num_splits)
    # split s covers entries [s * split_len, (s + 1) * split_len), a whole number of blocks
    split_len = -(-max(-(-max_len // num_splits), 1) // block_n) * block_n
    single = num_splits == 1
    if single:
        mid_o = mid_lse = out  # unused
    else:
        mid_o = torch.empty(B, h_q, num_splits, D, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(B, h_q, num_splits, dtype=torch.float32, device=q.device)
    cos, sin, slots, ring, ring_rows = rope or (out, out, rows, None, None)
    has_ring = ring is not None
    count = rows if single else _counters(q.device, B * h_kv)
    _split_kernel[(h_kv, B, num_splits)](
        q, k_cache, v_cache, page_table, rows, cache_lens, out, mid_o, mid_lse, count,
        scale * _LOG2E, split_len,
        stride_qb, stride_qh, k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), page_table.stride(0),
        out.stride(0), out.stride(1),
        h_q * num_splits, num_splits, 1,
        cos, sin, slots, ring if has_ring else out, ring_rows if has_ring else rows,
        **shape_constants(h_q, h_kv, D, page_size, block_n, num_splits),
        IEEE=q.dtype == torch.float32 or not q.is_cuda, ROPE=rope is not None,
        HAS_RING=has_ring, num_warps=num_warps, num_stages=num_stages)
    return out


def shape_constants(h_q: int, h_kv: int, head_dim: int, page_size: int, block_n: int,
                    num_splits: int) -> dict:
    """The kernel's compile-time constants that follow from the shapes and the tiling
    (an offline compile of the same variant, to read its registers and shared memory,
    takes them from here: `git show a66bdc1^:scripts/kernel_resources.py`)."""
    group = h_q // h_kv
    return dict(G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=head_dim,
                PAGE=page_size, BLOCK_N=block_n, SINGLE=num_splits == 1, HKV=h_kv,
                NUM_SPLITS=num_splits, S_PAD=triton.next_power_of_2(num_splits))
