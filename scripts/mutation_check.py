"""Does the fast tier notice when the algorithm breaks? One-line mutations of the GRPO code
(minisparse/grpo) and of the training loop's wiring (train.py), each followed by the fast
tier (pytest -m algorithm); a mutation the tier passes has survived.

    python -m scripts.mutation_check              # every mutation; exit 1 if one survives
    python -m scripts.mutation_check --list       # the mutations, numbered
    python -m scripts.mutation_check --only 1 12  # some of them
    python -m scripts.mutation_check --only 7 --tests tests/train/test_train_learns.py

Each mutation is applied in a scratch copy of the working tree (tracked files and new ones
git does not ignore), so the checkout is never touched and an interrupted check leaves
nothing behind. The unmutated tier runs first: it must pass for the others to mean
anything.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the tier, less the check that this list still applies (a mutation would fail it)
TIER = [sys.executable, "-m", "pytest", "-m", "algorithm", "-x", "-q", "-rf",
        "-p", "no:cacheprovider", "--ignore=tests/test_mutation_check.py"]


@dataclass(frozen=True)
class Mutation:
    path: str  # relative to the repository
    before: str  # text found exactly once in the file, within one line
    after: str
    what: str


G, T = "minisparse/grpo/", "train.py"
MUTATIONS = [
    # the update's inputs (grpo/objective.py, and the update phase in train.py)
    Mutation(G + "objective.py", "_rows(batch.old_logp, rows, device)",
             "_rows(batch.rollout_logp, rows, device)",
             "PPO ratio anchored on the sampler's log-probs, not the dense old policy's"),
    Mutation(G + "objective.py", "_rows(batch.weights, rows, device)",
             "_rows(batch.response_mask.float(), rows, device)",
             "importance weights dropped from the loss"),
    Mutation(G + "objective.py", "_rows(batch.keep, rows, device)",
             "_rows(batch.response_mask, rows, device)",
             "rejected and vetoed tokens left in the loss"),
    Mutation(G + "objective.py", "_rows(batch.ref_logp, rows, device)",
             "_rows(batch.old_logp, rows, device)",
             "KL taken to the old policy instead of the reference"),
    Mutation(T, "temperature=cfg.temperature,", "temperature=1.0,",
             "current log-probs at temperature 1, the old ones at the sampling temperature"),
    Mutation(T, "step_denominator(batch.keep[samples]",
             "step_denominator(batch.response_mask[samples]",
             "loss divided by every response token, kept or not"),
    # the objective (grpo/loss.py)
    Mutation(G + "loss.py", "pg_loss = agg(pg * weights)", "pg_loss = -agg(pg * weights)",
             "policy-gradient sign flipped"),
    Mutation(G + "loss.py", "return torch.maximum(unclipped, clipped)",
             "return torch.minimum(unclipped, clipped)",
             "PPO clip on the wrong side (optimistic bound)"),
    Mutation(G + "loss.py", "clipped_surrogate(logp - old_logp,",
             "clipped_surrogate(old_logp - logp,", "PPO ratio inverted (old over current)"),
    Mutation(G + "loss.py", "log_r = logp - ref_logp", "log_r = ref_logp - logp",
             "KL estimated in the reverse direction"),
    Mutation(G + "loss.py", "loss = loss + cfg.kl_coef * kl", "loss = loss",
             "KL term dropped from the loss (still logged)"),
    Mutation(G + "loss.py", "masked = values * keep_f", "masked = values",
             "aggregation ignores the kept-token mask"),
    Mutation(G + "loss.py", "return float(keep.sum().item())",
             "return float(keep.sum().item()) + 1", "token count off by one"),
    # the Sparse-RL corrections (grpo/corrections.py)
    Mutation(G + "corrections.py", "delta = (old_logp - rollout_logp)",
             "delta = (rollout_logp - old_logp)", "importance ratio inverted (sampler over dense)"),
    Mutation(G + "corrections.py", "return raw.clamp(max=upper)", "return raw",
             "truncation of the importance weights dropped"),
    Mutation(G + "corrections.py", "((ratio < lower) | (ratio > upper))", "(ratio < lower)",
             "rejection above the upper bound dropped"),
    Mutation(G + "corrections.py", "< veto_threshold)).any(dim=1)",
             "< veto_threshold)).all(dim=1)", "veto needs every token below the threshold"),
    Mutation(G + "corrections.py", "keep = mask & ~rejected & ~vetoed[:, None]",
             "keep = mask & ~rejected", "vetoed sequences kept"),
    Mutation(G + "corrections.py", "batch_mean(weights, keep, reduce)",
             "batch_mean(weights, mask, reduce)",
             "weights normalised over rejected tokens too"),
    Mutation(G + "corrections.py", "seq = total / mask.sum(dim=1, keepdim=True).clamp(min=1)",
             "seq = total / (mask.sum(dim=1, keepdim=True) + 1)",
             "geometric mean over one token too many"),
    Mutation(G + "advantages.py", "centered = groups - groups.mean(dim=1, keepdim=True)",
             "centered = groups", "group baseline dropped from the advantage"),
    # the loop's wiring (train.py)
    Mutation(T, "compute_corrections(old_logp, batch.rollout_logp,",
             "compute_corrections(batch.rollout_logp, old_logp,",
             "corrections' two log-prob arguments swapped"),
    Mutation(T, "mismatch_metrics(old_logp, batch.rollout_logp,",
             "mismatch_metrics(batch.rollout_logp, old_logp,",
             "mismatch metrics' two log-prob arguments swapped"),
    Mutation(T, "ref_logp = batch_logprobs(ref, *args)",
             "ref_logp = batch_logprobs(module, *args)",
             "reference log-probs taken from the policy"),
    Mutation(T, "keep=corr.keep)", "keep=batch.response_mask)",
             "the corrections' kept-token mask not handed to the update"),
    Mutation(T, "run.plan.logprob_tokens, cfg.temperature,", "run.plan.logprob_tokens, 1.0,",
             "old and reference log-probs at temperature 1"),
    Mutation(T, "batch.rewards, cfg.n_samples_per_prompt,", "batch.rewards, 1,",
             "advantages against groups of one sample (every advantage 0)"),
    Mutation(G + "objective.py", "to_device(t[rows], device)", "to_device(t[: len(rows)], device)",
             "a micro-batch reads the batch's first rows, not its own"),
    # the collectives passed in (grpo/advantages.py, grpo/dynamic_sampling.py)
    Mutation(G + "advantages.py", "sums = reduce(torch.stack(", "sums = alone(torch.stack(",
             "REINFORCE++ whitening over this rank's samples, not all ranks'"),
    Mutation(G + "dynamic_sampling.py", 'any_short = reduce(torch.tensor([short]',
             'any_short = alone(torch.tensor([short]',
             "a rank stops drawing while another is still short"),
]


def apply(text: str, m: Mutation) -> str:
    """text with m applied; ValueError unless m.before occurs exactly once, on one line."""
    if "\n" in m.before or text.count(m.before) != 1:
        raise ValueError(f"{m.path}: expected {m.before!r} exactly once "
                         f"(found {text.count(m.before)}); update this mutation")
    return text.replace(m.before, m.after)


def scratch_copy(target: Path) -> None:
    """The working tree's files (tracked, and new ones git does not ignore) under target."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=REPO, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = REPO / name
        if src.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target / name)


def run_tier(tree: Path, tests: list[str], timeout: float) -> tuple[bool, str, float]:
    """(passed, first failing test or why, seconds) of the fast tier's tests in tree."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        out = subprocess.run(TIER + tests, cwd=tree, env=env, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s", time.perf_counter() - start
    failed = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("FAILED ")]
    errors = [line for line in out.stdout.splitlines() if line.startswith("ERROR ")]
    why = failed[0] if failed else (errors[0] if errors else out.stdout.strip()[-300:])
    return out.returncode == 0, why, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    parser.add_argument("--only", type=int, nargs="+", metavar="N",
                        help="run these mutations (numbers from --list)")
    parser.add_argument("--tests", nargs="+", default=["tests"], metavar="PATH",
                        help="test files or folders to run (default: all of tests/)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the unmutated run")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds one tier run may take (default 900)")
    args = parser.parse_args()
    chosen = [(i, m) for i, m in enumerate(MUTATIONS, 1) if not args.only or i in args.only]
    if args.list:
        for i, m in chosen:
            print(f"{i:3d}  {m.path}: {m.what}\n       {m.before!r} -> {m.after!r}")
        return 0
    with tempfile.TemporaryDirectory(prefix="mutation-check-") as tmp:
        tree = Path(tmp)
        scratch_copy(tree)
        for _, m in chosen:  # every mutation still applies, before any run
            apply((tree / m.path).read_text(), m)
        if not args.no_baseline:
            passed, why, seconds = run_tier(tree, args.tests, args.timeout)
            print(f"  unmutated: {'passes' if passed else 'FAILS: ' + why} ({seconds:.0f} s)",
                  flush=True)
            if not passed:
                return 2
        survived = []
        for i, m in chosen:
            original = (tree / m.path).read_text()
            (tree / m.path).write_text(apply(original, m))
            try:
                passed, why, seconds = run_tier(tree, args.tests, args.timeout)
            finally:
                (tree / m.path).write_text(original)
            verdict = "SURVIVED" if passed else f"caught by {why}"
            print(f"{i:3d} {m.what}: {verdict} ({seconds:.0f} s)", flush=True)
            if passed:
                survived.append(i)
    print(f"{len(chosen) - len(survived)} of {len(chosen)} mutations caught"
          + (f"; survived: {', '.join(map(str, survived))}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
