"""LM head + log-softmax gather (+ entropy) fused in chunks of tokens.

The unfused path materialises [tokens x vocabulary] logits: at 8,192 tokens and Qwen's
151,936-word vocabulary that is 2.5 GB in bf16, 5 GB in float32, and autograd keeps
both plus the softmax gradient. Here each chunk of rows is projected, reduced to its
log-prob (and entropy) and dropped; the backward recomputes the chunk's logits and
turns them straight into the hidden-state and weight gradients. Peak extra memory is
one chunk's logits, whatever the micro-batch size, for one more LM-head GEMM per chunk
in the backward (2·T·H·V FLOPs, ~6% of a 3B model's update).

Numerics follow the unfused path: logits in the weight dtype, then float32 for the
division by temperature, log-sum-exp and softmax.
"""

from __future__ import annotations

import torch


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


class ChunkedLogprobs(torch.autograd.Function):
    """(log-probs [T], entropy [T]) of targets under softmax(hidden @ weight.T / temperature)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, with_entropy: bool):
        n = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)  # float64 stays (tests)
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        ent = torch.empty(n if with_entropy else 0, dtype=dtype, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            logits, lse, logp[s:e] = _chunk_stats(hidden[s:e], weight, targets[s:e], temperature)
            if with_entropy:
                ent[s:e] = entropy_from(logits, lse)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)  # an unused output (entropy) costs nothing
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, targets = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = None
        if need_w:
            grad_w = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32))
        n = hidden.shape[0]
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            grad_z = _logits_grad(
                *_chunk_stats(hidden[s:e], weight, targets[s:e], temperature)[:2],
                targets[s:e],
                None if grad_logp is None else grad_logp[s:e],
                None if grad_ent is None else grad_ent[s:e],
            )
            if temperature != 1.0:
                grad_z /= temperature
            grad_z = grad_z.to(weight.dtype)
            if need_h:
                grad_h[s:e] = grad_z @ weight
            if need_w:
                grad_w += grad_z.t() @ hidden[s:e]
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


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
    logp, ent = ChunkedLogprobs.apply(
        hidden, weight, targets, float(temperature), int(chunk), bool(with_entropy)
    )
    return logp, ent if with_entropy else None
