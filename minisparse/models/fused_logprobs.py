"""LM head + log-softmax gather (+ entropy) fused in chunks of tokens.

The unfused path materialises [tokens x vocabulary] logits: at 8,192 tokens and Qwen's
151,936-word vocabulary that is 2.5 GB in bf16, 5 GB in float32, and autograd keeps
both plus the softmax gradient. Here each chunk of rows is projected, reduced to its
log-prob (and entropy) and dropped; the backward recomputes the chunk's logits and
turns them straight into the hidden-state and weight gradients. Peak extra memory is
one chunk's logits, whatever the micro-batch size, for one more LM-head GEMM per chunk
in the backward (2·T·H·V FLOPs, ~6% of a 3B model's update).

Numerics follow the unfused path: logits in the weight dtype, then float32 for the
division by temperature, log-sum-exp and softmax. On CUDA that per-row work runs as two
Triton kernels (fused_logprobs_triton.py), one read of the chunk's logits each, and the
weight gradient is summed in float32 by the GEMM itself; the PyTorch ops below are the
CPU path and the reference the kernels are tested against.
"""

from __future__ import annotations

import torch

from minisparse.utils.kernels import triton_module


def _chunk_stats(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float32 logits / T, log-sum-exp, log-prob of the targets) of one chunk of rows."""
    logits = hidden @ weight.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    return logits, lse, logp


def entropy_from(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per row, given the rows' log-sum-exp: H = lse - E_p[z]."""
    return lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def _logits_grad(
    logits: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_ent: torch.Tensor | None,
) -> torch.Tensor:
    """d loss / d logits of one chunk, reusing the logits' storage (two [rows, V] float32
    buffers at most): d logp_t / dz = onehot(t) - p and d H / dz = -p (log p + H)."""
    log_p = logits.sub_(lse[:, None])
    probs = torch.exp(log_p)
    coef = torch.zeros_like(lse) if grad_logp is None else grad_logp
    if grad_ent is None:
        grad_z = probs.mul_(-coef[:, None])
    else:
        ent = -(probs * log_p).sum(-1)
        grad_z = probs.mul_(log_p.add_(ent[:, None]).mul_(grad_ent[:, None]).add_(coef[:, None]))
        grad_z.neg_()
    if grad_logp is not None:
        grad_z.scatter_add_(-1, targets[:, None], grad_logp[:, None].to(grad_z.dtype))
    return grad_z


KERNELS = "minisparse.models.fused_logprobs_triton"  # the CUDA path (a Triton kernel module)


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, for a float32 acc and low-precision a, b: on CUDA the GEMM adds into
    acc itself (float32 out of bf16 operands) instead of going through a bf16 product."""
    if acc.is_cuda and acc.dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc += (a @ b).to(acc.dtype)


def _logits_buffer(hidden: torch.Tensor, weight: torch.Tensor, chunk: int) -> torch.Tensor | None:
    """One chunk's logits, reused by every chunk of a pass (None for no rows)."""
    n = hidden.shape[0]
    return hidden.new_empty(min(chunk, n), weight.shape[0]) if n else None


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor,
                  buf: torch.Tensor | None) -> torch.Tensor:
    """hidden @ weight.T, into buf's first rows when given (one allocation for all chunks)."""
    if buf is None:
        return hidden @ weight.t()
    return torch.mm(hidden, weight.t(), out=buf[: hidden.shape[0]])


class ChunkedLogprobs(torch.autograd.Function):
    """(log-probs [T], entropy [T]) of targets under softmax(hidden @ weight.T / temperature).
    kernels: the Triton module (fused_logprobs_triton) for the per-row softmax work, or
    None for the PyTorch path."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int,
                with_entropy: bool, kernels=None):
        n = hidden.shape[0]
        dtype = torch.float32 if kernels else torch.promote_types(hidden.dtype, torch.float32)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        ent = torch.empty(n if with_entropy else 0, dtype=dtype, device=hidden.device)
        buf = _logits_buffer(hidden, weight, chunk) if kernels else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            if kernels:
                logits = _chunk_logits(hidden[s:e], weight, buf)
                lse[s:e], logp[s:e], h = kernels.row_stats(logits, targets[s:e], temperature,
                                                           with_entropy)
            else:
                logits, lse[s:e], logp[s:e] = _chunk_stats(hidden[s:e], weight, targets[s:e],
                                                           temperature)
                h = entropy_from(logits, lse[s:e]) if with_entropy else None
            if with_entropy:
                ent[s:e] = h
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature, ctx.chunk, ctx.kernels = temperature, chunk, kernels
        ctx.set_materialize_grads(False)  # an unused output (entropy) costs nothing
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        temperature, chunk, kernels = ctx.temperature, ctx.chunk, ctx.kernels
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = None
        if need_w:
            grad_w = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32))
        n = hidden.shape[0]
        buf = _logits_buffer(hidden, weight, chunk) if kernels else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            g_logp = None if grad_logp is None else grad_logp[s:e]
            g_ent = None if grad_ent is None else grad_ent[s:e]
            if kernels:
                grad_z = kernels.row_grad_(_chunk_logits(hidden[s:e], weight, buf), targets[s:e],
                                           lse[s:e], ent[s:e] if g_ent is not None else None,
                                           g_logp, g_ent, temperature)
            else:
                logits = _chunk_stats(hidden[s:e], weight, targets[s:e], temperature)[0]
                grad_z = _logits_grad(logits, lse[s:e], targets[s:e], g_logp, g_ent)
                if temperature != 1.0:
                    grad_z /= temperature
                grad_z = grad_z.to(weight.dtype)
            if need_h:
                torch.mm(grad_z, weight, out=grad_h[s:e])
            if need_w:
                _accumulate(grad_w, grad_z.t(), hidden[s:e])
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None, None, None, None, None)


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs, entropy or None), float32 [T], of targets [T] given hidden [T, H] and
    the LM head's weight [V, H], never holding more than `chunk` rows of logits."""
    if chunk <= 0:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [T, H] and weight [V, H] expected, got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    kernels = triton_module(KERNELS, hidden) if KERNELS else None
    logp, ent = ChunkedLogprobs.apply(
        hidden, weight, targets, float(temperature), int(chunk), bool(with_entropy), kernels
    )
    return logp, ent if with_entropy else None
