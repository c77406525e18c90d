"""Triton kernels for the per-layer elementwise work of a forward on CUDA: residual add +
RMSNorm (which also sums a split-K projection's partial products), RoPE + K/V cache write
(+ the query ring's write), SiLU(gate) * up.

Why: at decode batch sizes each of these is a handful of tiny PyTorch kernels (RMSNorm
alone is ~7: upcast, square, mean, rsqrt, scale, downcast, weight), ~35 launches per
layer in all, and inside a CUDA graph each still costs its launch and a pass over memory.
One kernel per step of the layer cuts that to ~10. Each kernel reproduces the PyTorch
path's roundings (float32 statistics, bf16 results of each HF operation), so the engine
computes the same function as models.py's reference path, which stays the CPU path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_kernel(X, RES, W, OUT, RES_OUT, eps, stride_part, N: tl.constexpr,
                    BLOCK: tl.constexpr, HAS_RES: tl.constexpr, PARTS: tl.constexpr):
    """PARTS > 0: X holds that many float32 partial products (a split-K GEMM's), summed
    in order and rounded to the model dtype, as the GEMM would have written its output."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    DT = OUT.dtype.element_ty
    if PARTS > 0:
        acc = tl.load(X + row * N + cols, mask=mask, other=0.0)
        for p in tl.static_range(1, PARTS):
            acc += tl.load(X + p * stride_part + row * N + cols, mask=mask, other=0.0)
        x = acc.to(DT)
    else:
        x = tl.load(X + row * N + cols, mask=mask, other=0.0)
    if HAS_RES:  # h = h + x, rounded to the model dtype as PyTorch's add
        x = (x.to(tl.float32) + tl.load(RES + row * N + cols, mask=mask, other=0.0)
             .to(tl.float32)).to(DT)
        tl.store(RES_OUT + row * N + cols, x, mask=mask)
    elif PARTS > 0:  # no residual: the summed product is the new residual stream
        tl.store(RES_OUT + row * N + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / N
    y = (h * tl.rsqrt(var + eps)).to(DT)
    w = tl.load(W + cols, mask=mask, other=0.0)
    tl.store(OUT + row * N + cols, (w.to(tl.float32) * y.to(tl.float32)).to(DT), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h) * weight, h) with h = residual + x (or x when residual is None);
    x, residual [T, N] contiguous in the model dtype. x may also be [S, T, N] float32:
    the S partial products of split_k_linear, summed here (in the model dtype of
    residual, or of weight when there is none) instead of in a separate reduce."""
    parts = x.shape[0] if x.dim() == 3 else 0
    T, N = x.shape[-2:]
    dtype = x.dtype if not parts else residual.dtype if residual is not None else weight.dtype
    out = torch.empty(T, N, dtype=dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None or parts else x
    if T:
        _add_rms_kernel[(T,)](x, residual if residual is not None else x, weight, out, res_out,
                              eps, T * N, N=N, BLOCK=triton.next_power_of_2(N),
                              HAS_RES=residual is not None, PARTS=parts,
                              num_warps=16 if parts else 4)
    return out, res_out


_SM_COUNT: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """The device's SM count (132, an H100/H200's, off CUDA: the interpreter's tests then
    take the GPU's decisions)."""
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


MIN_SPLIT_INNER = 2048  # inner size per part below which a part's GEMM is too short
_TILE = 128  # output rows and columns per tile of the GEMM kernels cuBLAS picks at these sizes
# The attention output projection: split while its output has at most 16 tiles, into parts
# of at least 384 inputs.
O_MAX_TILES, O_MIN_SPLIT_INNER = 16, 384


def _tiles(rows: int, out_features: int) -> int:
    return -(-rows // _TILE) * -(-out_features // _TILE)


def split_k_parts(rows: int, out_features: int, in_features: int, num_sms: int,
                  min_inner: int | None = None) -> int:
    """How many parts split_k_linear should use for a [rows, in] x [in, out] product: the
    most parts (a power of two) whose output tiles still fit in one wave over the SMs, each
    part at least min_inner (MIN_SPLIT_INNER) deep; 1 means F.linear. Measured on an H200
    (the sweep: `git show a66bdc1^:scripts/sweep_split_k.py`): the down projection of the
    3B shape at 16-512 rows gains 1.06-1.15x with its norm."""
    min_inner = MIN_SPLIT_INNER if min_inner is None else min_inner
    tiles = _tiles(rows, out_features)
    parts = 1
    while (2 * parts * tiles <= num_sms and in_features % (2 * parts) == 0
           and in_features // (2 * parts) >= min_inner
           and (in_features // (2 * parts)) % 8 == 0):
        parts *= 2
    return parts


def o_split_parts(rows: int, out_features: int, in_features: int, num_sms: int) -> int:
    """split_k_parts for the attention output projection, in parts of at least
    O_MIN_SPLIT_INNER inputs, while its output has at most O_MAX_TILES tiles (the 1.5B's
    and 3B's at up to 128 rows, the 7B's never). Why: on an H200 cuBLAS reads the 1.5B's
    o weights (1,536 x 1,536) at about 0.9 TB/s at 1-128 rows, 5.3-6.5 us a layer, where
    four parts of 384 inputs took 4.1-4.7 us (the 3B's: 6.1-6.7 against 4.8-5.8 in four
    parts); the 7B's (28 tiles) gained at 16 rows but lost at 64-128."""
    if _tiles(rows, out_features) > O_MAX_TILES:
        return 1
    return split_k_parts(rows, out_features, in_features, num_sms, O_MIN_SPLIT_INNER)


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """x @ weight.T as `parts` float32 partial products over slices of the inner
    dimension, [parts, T, N], one batched GEMM; add_rms_norm sums them.

    Why: at decode batch sizes a narrow projection (the down projection's 2,048 outputs
    from 11,008 inputs) has too few output tiles to fill the GPU; cuBLAS then splits K
    itself and runs a reduce kernel, at about half the rate of the wide GEMMs. Here the
    split is ours and its reduce rides in the next RMSNorm, which reads the residual
    stream anyway."""
    T, K = x.shape
    N = weight.shape[0]
    if K % parts:
        raise ValueError(f"split_k_linear: {parts} parts do not divide the inner size {K}")
    xs = x.view(T, parts, K // parts).transpose(0, 1)
    ws = weight.view(N, parts, K // parts).permute(1, 2, 0)
    if x.is_cuda and x.dtype != torch.float32:
        return torch.bmm(xs, ws, out_dtype=torch.float32)
    return torch.bmm(xs.float(), ws.float())  # exact products of the inputs either way


@triton.jit
def rotate_rows(base, rows, d, cos, sin, mask, D: tl.constexpr, DT: tl.constexpr):
    """RoPE of rows of D values at base + rows * D: x * cos + rotate_half(x) * sin, each
    product and the sum rounded to DT as in the PyTorch path. Shared with the decode
    attention kernel, which rotates its queries itself (triton_decode)."""
    first = d < D // 2
    partner = tl.where(first, d + D // 2, d - D // 2)
    sign = tl.where(first, -1.0, 1.0)
    x = tl.load(base + rows[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xr = tl.load(base + rows[:, None] * D + partner[None, :], mask=mask, other=0.0)
    a = (x * cos[None, :]).to(DT).to(tl.float32)
    b = ((xr.to(tl.float32) * sign[None, :]).to(DT).to(tl.float32) * sin[None, :])
    return (a + b.to(DT).to(tl.float32)).to(DT)


@triton.jit
def _rope_kernel(QKV, COS, SIN, Q_OUT, K_CACHE, V_CACHE, SLOTS, RING, RING_ROWS, stride_t,
                 stride_slot, HQ: tl.constexpr, HKV: tl.constexpr, HQ_PAD: tl.constexpr,
                 HKV_PAD: tl.constexpr, D: tl.constexpr, HAS_RING: tl.constexpr):
    """One program per token: rotate its HQ query heads into Q_OUT (and into its query-ring
    row when it has one, RING_ROWS[t] >= 0), its HKV key heads into the cache slot, and
    copy its value heads there. Head counts are padded to powers of two (HQ_PAD, HKV_PAD:
    Triton's ranges) and masked, so 12 or 28 query heads (Qwen2.5-1.5B, 7B) run here too."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    cos = tl.load(COS + t * D + d).to(tl.float32)
    sin = tl.load(SIN + t * D + d).to(tl.float32)
    dt = Q_OUT.dtype.element_ty
    base = QKV + t * stride_t
    slot = tl.load(SLOTS + t).to(tl.int64)
    hq = tl.arange(0, HQ_PAD)
    qmask = (hq < HQ)[:, None]
    q = rotate_rows(base, hq, d, cos, sin, qmask, D, dt)
    tl.store(Q_OUT + t * HQ * D + hq[:, None] * D + d[None, :], q, mask=qmask)
    if HAS_RING:
        ring_row = tl.load(RING_ROWS + t)
        if ring_row >= 0:
            tl.store(RING + ring_row * HQ * D + hq[:, None] * D + d[None, :], q, mask=qmask)
    hk = tl.arange(0, HKV_PAD)
    kmask = (hk < HKV)[:, None]
    k = rotate_rows(base, HQ + hk, d, cos, sin, kmask, D, dt)
    tl.store(K_CACHE + slot * stride_slot + hk[:, None] * D + d[None, :], k, mask=kmask)
    v = tl.load(base + (HQ + HKV) * D + hk[:, None] * D + d[None, :], mask=kmask, other=0.0)
    tl.store(V_CACHE + slot * stride_slot + hk[:, None] * D + d[None, :], v, mask=kmask)


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                   num_kv_heads: int, ring: torch.Tensor | None = None,
                   ring_rows: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [T, (HQ + 2 HKV) D] (one fused projection); cos/sin [T, 1, D]; slots [T] pool
    slots. Writes rotated K and V into k/v_cache [S, HKV, D] at slots, returns rotated
    q [T, HQ, D]. With ring [R, HQ, D] (contiguous) and ring_rows [T], also writes token
    t's rotated q into ring row ring_rows[t] where that is >= 0 (compression's query
    ring, otherwise an index_put per layer). head_dim must be a power of two."""
    T = qkv.shape[0]
    D = cos.shape[-1]
    q = torch.empty(T, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    has_ring = ring is not None
    if has_ring and not ring.is_contiguous():
        raise ValueError("ring: must be contiguous [rows, H_q, D]")
    if T:
        _rope_kernel[(T,)](qkv, cos, sin, q, k_cache, v_cache, slots,
                           ring if has_ring else q, ring_rows if has_ring else slots,
                           qkv.stride(0), k_cache.stride(0), HQ=num_heads, HKV=num_kv_heads,
                           HQ_PAD=triton.next_power_of_2(num_heads),
                           HKV_PAD=triton.next_power_of_2(num_kv_heads), D=D,
                           HAS_RING=has_ring, num_warps=4)
    return q


def rope_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the RoPE kernels take these heads: any head counts (padded to powers of two
    inside), a power-of-two head_dim (Triton's ranges over D) that divides evenly in two."""
    return num_heads > 0 and num_kv_heads > 0 and head_dim >= 2 and \
        head_dim & (head_dim - 1) == 0


@triton.jit
def _silu_mul_kernel(GU, OUT, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < N
    g = tl.load(GU + row * 2 * N + c, mask=mask, other=0.0)
    u = tl.load(GU + row * 2 * N + N + c, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu: float32 math, model-dtype result
    tl.store(OUT + row * N + c, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2N] = [gate | up] (the fused projection)."""
    T, N2 = gate_up.shape
    N = N2 // 2
    out = torch.empty(T, N, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        block = 1024
        _silu_mul_kernel[(T, triton.cdiv(N, block))](gate_up, out, N=N, BLOCK=block, num_warps=4)
    return out
