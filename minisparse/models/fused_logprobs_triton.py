"""The fused LM head's per-row softmax work as two Triton kernels, for CUDA.

Why: after each chunk's logits GEMM the PyTorch path (fused_logprobs.py, kept as the
reference and the CPU path) makes about a dozen float32 passes over [rows, vocabulary]
(the float copy, log-sum-exp, then in the backward the recomputed log-sum-exp, exp,
products, the scatter and the cast back), several times the time of the GEMM itself at
Qwen's 151,936-word vocabulary. Here each row is read once in the logits' own dtype:

  row_stats: log-sum-exp, the target's log-prob and (optionally) the entropy of
             softmax(logits / T), one online pass;
  row_grad_: d loss / d logits from the saved log-sum-exp and entropy and the per-row
             upstream gradients of log-prob and entropy, written over the logits in
             place (the buffer the next GEMMs read).

Float32 arithmetic in registers; the logits stay in the GEMM's dtype (bf16 on a real
run), as the PyTorch path rounds them before its float32 softmax.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048  # vocabulary columns a program loads at once


@triton.jit
def _stats_kernel(LOGITS, TARGETS, LSE, LOGP, ENT, V, stride, inv_t,
                  WITH_ENT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    ptr = LOGITS + row.to(tl.int64) * stride
    cols = tl.arange(0, BLOCK)
    # per lane: running max, sum of exp(z - max) and sum of exp(z - max) * z
    m = tl.full([BLOCK], -float("inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    t = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        inside = idx < V
        z = tl.load(ptr + idx, mask=inside, other=-float("inf")).to(tl.float32) * inv_t
        new_m = tl.maximum(m, z)
        alive = new_m > -float("inf")
        scale = tl.where(alive, tl.exp(m - new_m), 0.0)
        e = tl.where(inside, tl.exp(z - new_m), 0.0)
        s = s * scale + e
        if WITH_ENT:
            t = t * scale + tl.where(inside, e * z, 0.0)
        m = new_m
    top = tl.max(m, axis=0)
    lane = tl.where(m > -float("inf"), tl.exp(m - top), 0.0)
    total = tl.sum(s * lane, axis=0)
    lse = top + tl.log(total)
    target = tl.load(TARGETS + row)
    z_t = tl.load(ptr + target).to(tl.float32) * inv_t
    tl.store(LSE + row, lse)
    tl.store(LOGP + row, z_t - lse)
    if WITH_ENT:
        tl.store(ENT + row, lse - tl.sum(t * lane, axis=0) / total)


@triton.jit
def _grad_kernel(LOGITS, TARGETS, LSE, ENT, G_LOGP, G_ENT, V, stride, inv_t,
                 HAS_LOGP: tl.constexpr, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    ptr = LOGITS + row.to(tl.int64) * stride
    cols = tl.arange(0, BLOCK)
    lse = tl.load(LSE + row)
    target = tl.load(TARGETS + row)
    g = 0.0
    if HAS_LOGP:
        g = tl.load(G_LOGP + row)
    ge = 0.0
    h = 0.0
    if HAS_ENT:
        ge = tl.load(G_ENT + row)
        h = tl.load(ENT + row)
    for start in range(0, V, BLOCK):
        idx = start + cols
        inside = idx < V
        z = tl.load(ptr + idx, mask=inside, other=0.0).to(tl.float32) * inv_t
        log_p = z - lse
        p = tl.exp(log_p)
        # d logp_target / dz = onehot - p;  d H / dz = -p (log p + H)
        grad = -g * p
        if HAS_ENT:
            grad -= ge * p * (log_p + h)
        grad = tl.where(idx == target, grad + g, grad)
        tl.store(ptr + idx, (grad * inv_t).to(LOGITS.dtype.element_ty), mask=inside)


def _check(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits [rows, V] with unit column stride and targets [rows] expected, "
                         f"got {tuple(logits.shape)} (strides {logits.stride()}) and "
                         f"{tuple(targets.shape)}")


def row_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
              with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log-sum-exp, log-prob of targets, entropy or None), float32 [rows], of
    softmax(logits / temperature) per row."""
    _check(logits, targets)
    rows, vocab = logits.shape
    lse, logp = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(2))
    ent = torch.empty(rows if with_entropy else 1, dtype=torch.float32, device=logits.device)
    if rows:
        _stats_kernel[(rows,)](logits, targets, lse, logp, ent, vocab, logits.stride(0),
                               1.0 / temperature, WITH_ENT=with_entropy, BLOCK=_BLOCK)
    return lse, logp, ent if with_entropy else None


def row_grad_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
              ent: torch.Tensor | None, grad_logp: torch.Tensor | None,
              grad_ent: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """Overwrite logits with d(sum grad_logp * logp + grad_ent * entropy) / d logits, given
    the rows' log-sum-exp (and entropy, where grad_ent is given) from row_stats."""
    _check(logits, targets)
    if grad_ent is not None and ent is None:
        raise ValueError("an entropy gradient needs the rows' entropy")
    rows, vocab = logits.shape
    if rows:
        dummy = lse  # never read: the flags leave its loads out
        _grad_kernel[(rows,)](
            logits, targets, lse, dummy if ent is None else ent,
            dummy if grad_logp is None else grad_logp.float().contiguous(),
            dummy if grad_ent is None else grad_ent.float().contiguous(),
            vocab, logits.stride(0), 1.0 / temperature,
            HAS_LOGP=grad_logp is not None, HAS_ENT=grad_ent is not None, BLOCK=_BLOCK)
    return logits
