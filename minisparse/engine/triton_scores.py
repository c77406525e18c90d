"""One Triton kernel that scores every cache entry of a compaction for the shipped rules
(SnapKV, R-KV) straight from the paged KV pool and the query ring (compaction.py takes it
on CUDA; the rules' score_batch and select_batch are the reference and the path of every
other rule).

Why: the PyTorch route gathers a copy of every key (and of the ring's queries), then runs
some thirty kernels over them (scoring GEMM, softmaxes, pooling, the redundancy kernels,
top-k, sort); at a 256-sequence event of the 1.5B (H200) the redundancy took 1.74 ms, the
two gathers 0.83, top-k and sort 0.43 and the scoring GEMM 0.39 of its 4.9 ms of kernel
time, and at 16 sequences the event was bound by its ~40 launches. Here one
program per (sequence x layer, KV head) reads its keys through the page table and its
queries from the ring (their order there does not matter: the W softmaxes are averaged),
and writes one score row, the math of scoring.py:

1. the W queries' softmax statistics (max, sum) over the older entries, online, with the
   logits pooled over the query heads of the KV group and divided by sqrt(D); in the same
   pass the sum of the unit keys (R-KV);
2. the attention each older entry gets, averaged over the W queries, and (R-KV) its
   similarity column sum u_j . (sum_i u_i) - u_j . u_j, into a scratch row;
3. (R-KV) for each entry i the newest j != i whose similarity (in the input dtype) exceeds
   sim_threshold (0 when none), whose value S[i, j] is taken off column j: the search of
   triton_redundancy, walking key blocks from the newest down and stopping early. Under
   R-KV's tiles (`_TILES`) this step is a launch of its own, one program per (sequence x
   layer, KV head, block of entries), between a launch of steps 1-2 and one of 4-6: a
   program searching all its entries one block after another was the event's slowest
   part;
4. (R-KV) the softmax of the column means over the sequence's entries;
5. the attention max- or average-pooled along the entries (kernel_size), mixed with the
   redundancy as rkv.py mixes them;
6. with per-head selection (`keep`), the entries ScoringRule.select_batch keeps by those
   scores, ranked by counting (no sort), so a compaction launches no top-k or sort.
   Per-layer selection sums scores over heads, that is over programs: the rule's
   select_scored ranks the scores `scores` returns.

Scores of entries past a sequence's older ones are left for the selection to mask.
Under the interpreter (CPU tests) and for float32 keys the dots are exact float32, as in
triton_redundancy.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from minisparse.compression import triton_redundancy as tr
from minisparse.compression.scoring import NORM_EPS

# Tiles (BLOCK_N cache entries a step of the key passes, BLOCK_M entries whose newest
# near-duplicate one step of the search finds, BLOCK_R entries a step of the passes over a
# score row), warps, and whether R-KV's search runs as its own launch over (row, head,
# block of BLOCK_M entries), between the scoring and the selection: without and with R-KV's
# redundancy. The fastest in a sweep of one event of 16, 64 and 256 sequences of the 1.5B
# at 224 entries on an H200: SnapKV 0.37 / 0.86 / 2.60 ms against 0.54 / 1.01 / 3.15 at
# (64, 64, 64, 4); R-KV, its keys sharing a direction per head as real keys do, 0.51 /
# 1.21 / 4.27 against 0.75 / 1.89 / 6.59 at (64, 64, 64, 4) in one launch.
_TILES = {False: (64, 64, 64, 2, False), True: (32, 64, 32, 2, True)}


@triton.jit
def _keys(K, PT, pos, ok, d, dmask, PS, HD: tl.constexpr):
    """Entries pos of one (sequence, layer, KV head): K points at the layer and head, PT at
    the sequence's page-table row. Input dtype, zeros where not ok."""
    page = tl.load(PT + pos // PS, mask=ok, other=0).to(tl.int64)
    slot = page * PS + pos % PS
    return tl.load(K + slot[:, None] * HD + d[None, :], mask=ok[:, None] & dmask[None, :],
                   other=0.0)


@triton.jit
def _unit(k, eps):
    """float32 rows k over their norm + eps (zero rows stay zero)."""
    k = k.to(tl.float32)
    return k / (tl.sqrt(tl.sum(k * k, axis=1)) + eps)[:, None]


@triton.jit
def _dot_t(a, b, IEEE: tl.constexpr):
    """a @ b^T with a float32 result: exact float32 products (IEEE) or the input dtype's."""
    if IEEE:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(b))


@triton.jit
def _logits(Q, w, wok, d, dmask, k, sqrt_d, HQD: tl.constexpr, D: tl.constexpr,
            G: tl.constexpr, MEAN: tl.constexpr, IEEE: tl.constexpr):
    """[W_PAD, BLOCK_N] logits of the group's W queries (Q: its first head in the ring row
    of the sequence's first query) against keys k, pooled over the G heads, / sqrt(D)."""
    qmask = wok[:, None] & dmask[None, :]
    q_at = Q + w[:, None] * HQD + d[None, :]
    acc = _dot_t(tl.load(q_at, mask=qmask, other=0.0), k, IEEE)
    for g in tl.static_range(1, G):
        s = _dot_t(tl.load(q_at + g * D, mask=qmask, other=0.0), k, IEEE)
        if MEAN:
            acc += s
        else:
            acc = tl.maximum(acc, s)
    if MEAN:
        acc = acc / G
    return acc / sqrt_d


@triton.jit
def _last_above(K, PT, COL, length, lo, hi, PS, eps, threshold, d, dmask, HD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                HW: tl.constexpr):
    """Takes S[i, last(i)] off column last(i) of COL for every entry lo <= i < hi
    (step 3)."""
    DT = K.dtype.element_ty
    for m0 in range(lo, hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < hi
        q = tr.round_as(_unit(_keys(K, PT, rows, row_ok, d, dmask, PS, HD), eps), DT, HW)
        if not IEEE:
            q = q.to(DT)
        best = tl.full([BLOCK_M], -1, tl.int32)
        best_val = tl.zeros([BLOCK_M], tl.float32)
        first_val = tl.zeros([BLOCK_M], tl.float32)  # S[i, 0]: dropped when none is above
        n0 = ((length - 1) // BLOCK_N) * BLOCK_N
        while n0 >= 0:
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < length
            kc = tr.round_as(_unit(_keys(K, PT, cols, col_ok, d, dmask, PS, HD), eps), DT, HW)
            if not IEEE:
                kc = kc.to(DT)
            s = tr.round_as(_dot_t(q, kc, IEEE), DT, HW)  # the similarity in the input dtype
            s = tl.where(cols[None, :] == rows[:, None], 0.0, s)  # zeroed diagonal
            best, best_val = tr.newest_above(s, cols, col_ok, threshold, best, best_val)
            if n0 == 0:
                first_val = tl.sum(tl.where(cols[None, :] == 0, s, 0.0), axis=1)
            done = tl.min(tl.where(row_ok, best, 0), axis=0) >= 0
            n0 = tl.where(done, -1, n0 - BLOCK_N)
        found = best >= 0
        tl.atomic_add(COL + tl.where(found, best, 0), -tl.where(found, best_val, first_val),
                      mask=row_ok)


@triton.jit
def _keep_top(SCORES, KEEP, first, older, length, top, W: tl.constexpr, W_PAD: tl.constexpr,
              BLOCK: tl.constexpr):
    """Step 6 (per-head selection): KEEP[:top] the `top` best-scored entries of
    first..older-1, ascending, then the last W entries. An entry's rank is the number of
    entries scored above it (ties: the older first), so no sort is needed: the kept ones
    are the ranks below `top`, placed by a running count."""
    kept = tl.zeros([], tl.int32)
    for j0 in range(0, older, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        j_ok = (j >= first) & (j < older)
        sj = tl.load(SCORES + j, mask=j_ok, other=0.0)
        rank = tl.zeros([BLOCK], tl.int32)
        for i0 in range(0, older, BLOCK):
            i = i0 + tl.arange(0, BLOCK)
            i_ok = (i >= first) & (i < older)
            si = tl.load(SCORES + i, mask=i_ok, other=0.0)
            above = (si[:, None] > sj[None, :]) | ((si[:, None] == sj[None, :])
                                                    & (i[:, None] < j[None, :]))
            rank += tl.sum((above & i_ok[:, None]).to(tl.int32), axis=0)
        keep = j_ok & (rank < top)
        at = kept + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(KEEP + at, j.to(tl.int64), mask=keep & (at < top))
        kept += tl.sum(keep.to(tl.int32), axis=0)
    w = tl.arange(0, W_PAD)
    tl.store(KEEP + top + w, (length - W + w).to(tl.int64), mask=w < W)


@triton.jit
def _softmax_stats(K, PT, Q, length, older, PS, eps, sqrt_d, d, dmask, w, wok,
                   HD: tl.constexpr, D: tl.constexpr, G: tl.constexpr, W_PAD: tl.constexpr,
                   D_PAD: tl.constexpr, GROUP_MEAN: tl.constexpr, REDUNDANCY: tl.constexpr,
                   BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Step 1: each query's logit max and exp-sum over the older entries (online), and
    the sum of the unit keys (R-KV)."""
    m = tl.full([W_PAD], float("-inf"), tl.float32)
    s = tl.zeros([W_PAD], tl.float32)
    total = tl.zeros([D_PAD], tl.float32)
    for n0 in range(0, length, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        k = _keys(K, PT, pos, pos < length, d, dmask, PS, HD)
        if REDUNDANCY:
            total += tl.sum(_unit(k, eps), axis=0)
        lg = _logits(Q, w, wok, d, dmask, k, sqrt_d, G * HD, D, G, GROUP_MEAN, IEEE)
        lg = tl.where((pos < older)[None, :], lg, float("-inf"))
        m_new = tl.maximum(m, tl.max(lg, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(lg - m_new[:, None]), axis=1)
        m = m_new
    return m, s, total


@triton.jit
def _attention_columns(K, PT, Q, ATTN, COL, length, older, PS, eps, sqrt_d, d, dmask, w,
                       wok, m, s, total, HD: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                       W: tl.constexpr, GROUP_MEAN: tl.constexpr, REDUNDANCY: tl.constexpr,
                       BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Step 2: ATTN the attention of each entry averaged over the W queries; COL (R-KV)
    its similarity column sum without the dropped entries."""
    for n0 in range(0, length, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < length
        k = _keys(K, PT, pos, ok, d, dmask, PS, HD)
        lg = _logits(Q, w, wok, d, dmask, k, sqrt_d, G * HD, D, G, GROUP_MEAN, IEEE)
        p = tl.exp(tl.where((pos < older)[None, :], lg, float("-inf")) - m[:, None]) / s[:, None]
        tl.store(ATTN + pos, tl.sum(tl.where(wok[:, None], p, 0.0), axis=0) / W, mask=ok)
        if REDUNDANCY:
            u = _unit(k, eps)
            tl.store(COL + pos, tl.sum(u * total[None, :], axis=1) - tl.sum(u * u, axis=1),
                     mask=ok)


@triton.jit
def _column_softmax_stats(COL, length, BLOCK_N: tl.constexpr):
    """Step 4: max and exp-sum of the column means COL / length over the entries."""
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    for n0 in range(0, length, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        x = tl.load(COL + pos, mask=pos < length, other=float("-inf")) / length
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    return m, s


@triton.jit
def _mix(OUT, ATTN, COL, length, older, LMAX, mix, m_red, s_red, KS: tl.constexpr,
         MAX_POOL: tl.constexpr, REDUNDANCY: tl.constexpr, BLOCK_N: tl.constexpr):
    """Step 5: OUT the attention pooled along the entries (zeros outside the older ones),
    mixed with the softmax of the column means (R-KV)."""
    for n0 in range(0, LMAX, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pooled = tl.zeros([BLOCK_N], tl.float32)
        for o in tl.static_range(KS):
            at = pos + (o - KS // 2)
            a = tl.load(ATTN + at, mask=(at >= 0) & (at < older), other=0.0)
            if MAX_POOL:
                pooled = tl.maximum(pooled, a)
            else:
                pooled += a
        if not MAX_POOL:
            pooled = pooled / KS
        score = pooled
        if REDUNDANCY:
            x = tl.load(COL + pos, mask=pos < length, other=float("-inf")) / length
            score = mix * pooled - (1.0 - mix) * (tl.exp(x - m_red) / s_red)
        tl.store(OUT + pos, score, mask=pos < LMAX)


@triton.jit(do_not_specialize=["LMAX"], do_not_specialize_on_alignment=["ROWS", "LENS", "FIRST"])
def _scores_kernel(K, QR, PT, ROWS, LENS, FIRST, OUT, SCR, KEEP, stride_kl, stride_ql,
                   stride_pt, LMAX, PS, eps, sqrt_d, threshold, mix, TOP,
                   SELECT: tl.constexpr, LAYERS: tl.constexpr, H: tl.constexpr,
                   G: tl.constexpr, W: tl.constexpr, W_PAD: tl.constexpr, D: tl.constexpr,
                   D_PAD: tl.constexpr, KS: tl.constexpr, MAX_POOL: tl.constexpr,
                   GROUP_MEAN: tl.constexpr, REDUNDANCY: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
                   HW: tl.constexpr, COLUMNS: tl.constexpr, SEARCH: tl.constexpr,
                   FINISH: tl.constexpr):
    r, h = tl.program_id(0), tl.program_id(1)
    i, layer = r // LAYERS, r % LAYERS
    seq = tl.load(ROWS + i)
    length = tl.load(LENS + i).to(tl.int32)
    older = length - W
    K = K + layer.to(tl.int64) * stride_kl + h * D
    PT = PT + seq * stride_pt
    Q = QR + layer.to(tl.int64) * stride_ql + (seq * W).to(tl.int64) * (G * H * D) + h * G * D
    row = (r * H + h).to(tl.int64) * LMAX
    ATTN, COL = SCR + 2 * row, SCR + 2 * row + LMAX
    d = tl.arange(0, D_PAD)
    dmask = d < D
    w = tl.arange(0, W_PAD)
    wok = w < W
    if COLUMNS:
        m, s, total = _softmax_stats(K, PT, Q, length, older, PS, eps, sqrt_d, d, dmask, w,
                                     wok, H * D, D, G, W_PAD, D_PAD, GROUP_MEAN, REDUNDANCY,
                                     BLOCK_N, IEEE)
        _attention_columns(K, PT, Q, ATTN, COL, length, older, PS, eps, sqrt_d, d, dmask, w,
                           wok, m, s, total, H * D, D, G, W, GROUP_MEAN, REDUNDANCY, BLOCK_N,
                           IEEE)
        tl.debug_barrier()
    if SEARCH:  # R-KV: every entry of the row here, or (third grid axis) one block of them
        lo = 0
        hi = length
        if not COLUMNS:
            lo = tl.program_id(2) * BLOCK_M
            hi = tl.minimum(length, lo + BLOCK_M)
        _last_above(K, PT, COL, length, lo, hi, PS, eps, threshold, d, dmask, H * D, BLOCK_M,
                    BLOCK_N, IEEE, HW)
        tl.debug_barrier()
    if FINISH:
        m_red = tl.zeros([], tl.float32)
        s_red = tl.zeros([], tl.float32)
        if REDUNDANCY:
            m_red, s_red = _column_softmax_stats(COL, length, BLOCK_R)
        _mix(OUT + row, ATTN, COL, length, older, LMAX, mix, m_red, s_red, KS, MAX_POOL,
             REDUNDANCY, BLOCK_R)
        if SELECT:  # 6.
            tl.debug_barrier()
            keep = KEEP + (r * H + h).to(tl.int64) * (TOP + W)
            _keep_top(OUT + row, keep, tl.load(FIRST + i).to(tl.int32), older, length, TOP,
                      W, W_PAD, BLOCK_R)


def scores(k: torch.Tensor, q_ring: torch.Tensor, page_table: torch.Tensor, page_size: int,
           rows: torch.Tensor, lens: torch.Tensor, lmax: int, cfg,
           redundancy: bool) -> torch.Tensor:
    """Scores [len(rows) * layers, H_kv, lmax] (float32) of cache entries 0..lens[i]-1 of
    sequences rows[i] in every layer, as SnapKV.score_batch (redundancy False) or
    RKV.score_batch (True) scores them, at positions below lens[i] - window (the rest
    hold anything). k [layers, slots, H_kv, D] the pool's keys; q_ring [layers, rows *
    window, H_q, D] its query ring; cfg: the rule's CompressConfig."""
    return _launch(k, q_ring, page_table, page_size, rows, lens, lmax, cfg, redundancy)[0]


def keep(k: torch.Tensor, q_ring: torch.Tensor, page_table: torch.Tensor, page_size: int,
         rows: torch.Tensor, lens: torch.Tensor, first: torch.Tensor, lmax: int, cfg,
         redundancy: bool) -> torch.Tensor:
    """What ScoringRule.select_batch keeps by those scores under per-head selection, in
    the same kernel: [len(rows) * layers, H_kv, budget] ascending, each row's top
    budget - window entries from first[i] on (by score; ties: the older), then its last
    window entries."""
    return _launch(k, q_ring, page_table, page_size, rows, lens, lmax, cfg, redundancy,
                   first)[1]


def _launch(k: torch.Tensor, q_ring: torch.Tensor, page_table: torch.Tensor, page_size: int,
            rows: torch.Tensor, lens: torch.Tensor, lmax: int, cfg, redundancy: bool,
            first: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scores, kept positions or None without first): one program per (sequence x layer,
    KV head) in one launch, or with a split search in three (steps 1-2, 3, 4-6)."""
    n_layers, _, h_kv, dim = k.shape
    h_q, window, n = q_ring.shape[2], cfg.window, rows.shape[0] * n_layers
    if not (k.is_contiguous() and q_ring.is_contiguous() and h_q % h_kv == 0):
        raise ValueError("scores: k [layers, slots, H_kv, D] and q_ring [layers, rows * W, "
                         "H_q, D] must be contiguous with H_q a multiple of H_kv")
    out = torch.empty(n, h_kv, lmax, dtype=torch.float32, device=k.device)
    kept = None if first is None else torch.empty(n, h_kv, cfg.budget, dtype=torch.long,
                                                  device=k.device)
    if n:
        block_n, block_m, block_r, warps, split = _TILES[redundancy]
        scratch = torch.empty(n, h_kv, 2, lmax, dtype=torch.float32, device=k.device)
        args = (k, q_ring, page_table, rows, lens, lens if first is None else first, out,
                scratch, out if kept is None else kept, k.stride(0), q_ring.stride(0),
                page_table.stride(0), lmax, page_size, NORM_EPS, math.sqrt(dim),
                tr.threshold_as(cfg.sim_threshold, k.dtype), float(cfg.mix_lambda),
                cfg.budget - window)
        settings = dict(
            SELECT=first is not None, LAYERS=n_layers, H=h_kv, G=h_q // h_kv, W=window,
            W_PAD=max(16, triton.next_power_of_2(window)), D=dim,
            D_PAD=max(16, triton.next_power_of_2(dim)), KS=cfg.kernel_size,
            MAX_POOL=cfg.pooling == "max", GROUP_MEAN=cfg.group_pooling != "max",
            REDUNDANCY=redundancy, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
            IEEE=k.dtype == torch.float32 or not k.is_cuda, HW=k.is_cuda, num_warps=warps)
        if split and redundancy:  # the search over its own grid, between two launches
            stages = [((n, h_kv), (True, False, False)),
                      ((n, h_kv, triton.cdiv(lmax, block_m)), (False, True, False)),
                      ((n, h_kv), (False, False, True))]
        else:
            stages = [((n, h_kv), (True, redundancy, True))]
        for grid, (columns, search, finish) in stages:
            _scores_kernel[grid](*args, **settings, COLUMNS=columns, SEARCH=search,
                                 FINISH=finish)
    return out, kept
