"""How far the sampler (compressed KV cache) is from the dense policy that is trained.

Computed once per rollout from the engine's log-probs and the dense old log-probs over
all response tokens, before any correction: these are the numbers that say whether
compression is hurting (Sparse-RL's mismatch diagnostics, as in verl's rollout-IS
metrics). Token ratio r = pi_dense / pi_rollout on tokens sampled from the rollout policy.
"""

from __future__ import annotations

import torch

from minisparse.grpo.corrections import LOG_RATIO_CLAMP, log_ratio


def mismatch_metrics(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Perplexities, KL (k1, k3) and chi-square between sampler and dense policy.

    rollout/training ppl: mean over sequences of exp(-mean token log-prob);
    ppl_ratio: mean over sequences of training_ppl / rollout_ppl;
    kl_k1 = mean(-log r), kl_k3 = mean(r - 1 - log r)  (KL(rollout || dense), per token);
    chi2_token = mean(r^2) - 1; chi2_seq = mean over sequences of prod(r)^2 - 1.
    """
    mask = mask.bool()
    m = mask.float()
    lengths = m.sum(dim=1).clamp(min=1)
    valid_rows = mask.any(dim=1)
    if not valid_rows.any():
        return {}
    delta = log_ratio(old_logp.float(), rollout_logp.float(), mask)  # log r
    n_tokens = m.sum()
    mean_rollout = (rollout_logp.float() * m).sum(dim=1) / lengths
    mean_old = (old_logp.float() * m).sum(dim=1) / lengths
    seq_log_r = delta.sum(dim=1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rows = lambda x: x[valid_rows].mean().item()
    r = delta.exp()
    return {
        "mismatch/rollout_ppl": rows(torch.exp(-mean_rollout)),
        "mismatch/training_ppl": rows(torch.exp(-mean_old)),
        "mismatch/ppl_ratio": rows(torch.exp(mean_rollout - mean_old)),
        "mismatch/kl_k1": ((-delta * m).sum() / n_tokens).item(),
        "mismatch/kl_k3": (((r - 1 - delta) * m).sum() / n_tokens).item(),
        "mismatch/chi2_token": ((r.square() * m).sum() / n_tokens).item() - 1.0,
        "mismatch/chi2_seq": rows(torch.exp(2 * seq_log_r)) - 1.0,
    }
