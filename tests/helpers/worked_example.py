"""One Sparse-RL batch, worked by hand, shared by the algorithm tests.

Three samples whose four log-probs all differ, given as ratios between them so every
expected number below can be worked out on paper:

  s = pi_old / pi_rollout  (dense policy over the compressed sampler: the correction)
  q = pi_now / pi_old      (the PPO ratio: the policy being updated over the dense old one)
  k = pi_now / pi_ref      (the KL term's ratio)

  sample  advantage  s                  q                k
  0       +1         2,   1.25, 0.75    1.1, 1.3, 0.9    2,   1,   0.5
  1       -1         1.2, 0.6           0.7, 1.1         0.5, 2
  2       +0.5       1.1, 1e-5          1,   1           1,   1      (1e-5: vetoed)

Token ratios are checked against [0.5, 1.5] (truncation at 1.5, rejection outside),
PPO's band is [0.8, 1.2] and the veto threshold 1e-4 (the LossConfig defaults).
Sequence level: products 1.875, 0.72, 1.1e-5; geometric: their 3rd / 2nd / 2nd roots.

`tensors(now)` anchors the table on real current log-probs (a model's), so a test of
the update can run this batch through a real policy and still expect the same numbers.
"""
from __future__ import annotations

import math

import torch

from minisparse.config.schema import LossConfig

L2 = math.log(2.0)
MASK = torch.tensor([[True, True, True], [True, True, False], [True, True, False]])
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5])
S = [[2.0, 1.25, 0.75], [1.2, 0.6, 1.0], [1.1, 1e-5, 1.0]]
Q = [[1.1, 1.3, 0.9], [0.7, 1.1, 1.0], [1.0, 1.0, 1.0]]
K = [[2.0, 1.0, 0.5], [0.5, 2.0, 1.0], [1.0, 1.0, 1.0]]
KL_COEF = 0.1
# The current policy's probabilities (1 on padding); with the table's ratios every old,
# rollout and reference probability is below 1 too (the vetoed token: 1e-6 under the
# policy, 0.1 under the sampler).
NOW = torch.log(torch.tensor([[0.3, 0.5, 0.2], [0.4, 0.6, 1.0], [0.5, 1e-6, 1.0]]))
# Responses of the lengths above (3, 2, 2 tokens) for a model to score.
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
RESPONSES = [[10, 11, 12], [13, 14], [15, 16]]

# Per-token PPO term max(-A q, -A clip(q, 0.8, 1.2)), hand-computed:
#   sample 0 (A=+1): -1.1 | q=1.3 clipped to 1.2: -1.2 | -0.9
#   sample 1 (A=-1): q=0.7 clipped to 0.8: +0.8 | +1.1
#   sample 2 (A=+0.5): -0.5, -0.5
PG = [[-1.1, -1.2, -0.9], [0.8, 1.1, 0.0], [-0.5, -0.5, 0.0]]
CLIPPED = [[False, True, False], [True, False, False], [False, False, False]]
# Per-token k3 = 1/k + ln k - 1: k=2 -> ln2 - 0.5, k=1 -> 0, k=0.5 -> 1 - ln2
KL = [[L2 - 0.5, 0.0, 1 - L2], [1 - L2, L2 - 0.5, 0.0], [0.0, 0.0, 0.0]]

G0, G1 = 1.875 ** (1 / 3), 0.72 ** 0.5  # geometric means of samples 0 and 1
# (tis_level, rs_level) -> kept tokens and weights before normalisation, worked out:
#  token/token: 2 > 1.5 is truncated to 1.5 and rejected, sample 2 vetoed (1e-5)
#  sequence/sequence: 1.875 truncated to 1.5 and the whole of sample 0 rejected
#  geometric/geometric: 1.233 and 0.849 pass; sample 2 (0.0033) rejected and vetoed
#  token weights, sequence rejection: sample 0 leaves as a whole, sample 1 stays
#  token weights, geometric rejection: samples 0 and 1 stay whole (sample 0's 2 truncated to 1.5)
CASES = {
    ("token", "token"): ([[0, 1, 1], [1, 1, 0], [0, 0, 0]],
                         [[0, 1.25, 0.75], [1.2, 0.6, 0], [0, 0, 0]]),
    ("sequence", "sequence"): ([[0, 0, 0], [1, 1, 0], [0, 0, 0]],
                               [[0, 0, 0], [0.72, 0.72, 0], [0, 0, 0]]),
    ("geometric", "geometric"): ([[1, 1, 1], [1, 1, 0], [0, 0, 0]],
                                 [[G0, G0, G0], [G1, G1, 0], [0, 0, 0]]),
    ("token", "sequence"): ([[0, 0, 0], [1, 1, 0], [0, 0, 0]],
                            [[0, 0, 0], [1.2, 0.6, 0], [0, 0, 0]]),
    ("token", "geometric"): ([[1, 1, 1], [1, 1, 0], [0, 0, 0]],
                             [[1.5, 1.25, 0.75], [1.2, 0.6, 0], [0, 0, 0]]),
}


def loss_config(tis_level: str = "token", rs_level: str | None = None, **kw) -> LossConfig:
    """The LossConfig defaults (truncate at 1.5, reject outside [0.5, 1.5], veto 1e-4,
    batch normalisation, PPO band 0.2) with a visible KL term."""
    settings = {"kl_coef": KL_COEF, "kl_type": "low_var_kl", "aggregation": "token_mean", **kw}
    return LossConfig(tis_level=tis_level, rs_level=rs_level, **settings)


def expected(tis_level: str = "token", rs_level: str | None = None,
             normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep, weights) of a case above; normalised weights average 1 over the kept
    tokens."""
    keep_rows, weight_rows = CASES[(tis_level, rs_level or tis_level)]
    keep, weights = torch.tensor(keep_rows).bool(), torch.tensor(weight_rows)
    if normalize:
        weights = weights / weights[keep].mean()
    return keep, weights


def expected_loss(keep: torch.Tensor, weights: torch.Tensor,
                  aggregation: str = "token_mean") -> dict[str, float]:
    """pg_loss, kl, loss, ratio_mean and clip_frac for kept tokens and weights, from the
    hand-computed per-token tables (PG, KL, Q, CLIPPED): sums of table entries only."""
    pg = torch.tensor(PG) * weights
    per_token = {"pg_loss": pg, "kl": torch.tensor(KL), "ratio_mean": torch.tensor(Q),
                 "clip_frac": torch.tensor(CLIPPED).float()}
    k = keep.float()
    if aggregation == "token_mean":
        out = {name: (v * k).sum().item() / k.sum().item() for name, v in per_token.items()}
    else:  # sample_mean: each sample's mean over its kept tokens, averaged over samples
        rows = k.sum(dim=1) > 0
        out = {name: ((v * k).sum(dim=1)[rows] / k.sum(dim=1)[rows]).mean().item()
               for name, v in per_token.items()}
    out["loss"] = out["pg_loss"] + KL_COEF * out["kl"]
    return out


def tensors(now: torch.Tensor) -> dict[str, torch.Tensor]:
    """rollout, old and reference log-probs [3, 3] around current log-probs `now`, with
    the table's ratios between them (0 on padding, as a batch carries them)."""
    log = lambda t: torch.tensor(t).log()
    old = now - log(Q)
    out = {"now": now, "old": old, "rollout": old - log(S), "ref": now - log(K)}
    return {name: torch.where(MASK, t, 0.0) for name, t in out.items()}


def expected_grad(keep: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """d loss / d log pi_now per token (token_mean): the PPO term's -A w q where q is
    inside the band (0 where clipped), the KL term's coefficient x (1 - 1/k)."""
    q, k = torch.tensor(Q), torch.tensor(K)
    pg = torch.where(torch.tensor(CLIPPED), 0.0, -ADVANTAGES[:, None] * q) * weights
    return keep * (pg + KL_COEF * (1 - 1 / k)) / keep.sum()
