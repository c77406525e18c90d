"""Checks a run makes before any model loads: everything it reads is there and parses,
and where it writes is writable. A typo or a bad data row then costs a second, not the
minutes a 7B model takes to load (or the rollouts run before eval or a save finds it).
Each failure is one line naming the thing; train.py prints it and exits 2.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from minisparse.compression import check_rule
from minisparse.config.schema import Config, ConfigError
from minisparse.data.benchmarks import load_benchmarks
from minisparse.data.datasets import check_data
from minisparse.data.synthetic import Difficulty
from minisparse.data.reward_plugin import load_reward_function
from minisparse.engine import check_backend
from minisparse.trainer.checkpoint import CheckpointError, latest_checkpoint, trainer_state
from minisparse.models.loading import check_model_path


class PreflightError(RuntimeError):
    """Something a run needs that is missing or unusable; the message names it."""


@dataclass
class Checked:
    """What the checks read that the run uses."""

    eval_problems: dict | None  # benchmark name -> problems, when in-training eval is on
    resume_from: Path | None  # the newest complete checkpoint, when the run resumes


def check_run(cfg: Config, world: int, resume_required: bool) -> Checked:
    """Every check, cheapest first; raises on the first failure."""
    check_world(cfg, world)
    check_backend(cfg)
    check_rule(cfg.compress)
    check_model_path(cfg.model.path)
    check_data(cfg.data)
    if cfg.reward.function:
        load_reward_function(cfg.reward.function)
    check_output_dir(cfg.output_dir)
    resume_from = resume_checkpoint(cfg, resume_required)
    problems = None
    if cfg.eval_interval:
        problems = load_benchmarks(cfg.eval.benchmarks, cfg.eval.data_dir, cfg.eval.limit,
                                   Difficulty.from_config(cfg.data))
    return Checked(eval_problems=problems, resume_from=resume_from)


def check_world(cfg: Config, world: int) -> None:
    """Batch keys must split evenly over the ranks."""
    for key in ("rollout_batch_size", "global_batch_size"):
        if getattr(cfg, key) % world:
            raise ConfigError(
                f"config key '{key}' ({getattr(cfg, key)}) must be divisible "
                f"by the number of processes ({world})"
            )


def check_output_dir(path: str) -> None:
    """output_dir exists (made here) and takes a file: metrics, checkpoints and eval
    results all go there, and the first of them is written after a rollout."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise PreflightError(f"output_dir: cannot write to {path}: "
                             f"{exc.strerror or exc}") from None


def resume_checkpoint(cfg: Config, required: bool) -> Path | None:
    """The checkpoint the run continues from: the newest complete one under output_dir
    (--resume requires one; resume=auto takes one if there is; never: none), checked
    against this run's number of ranks."""
    if not required and cfg.resume == "never":
        return None
    path = latest_checkpoint(cfg.output_dir)
    if path is None:
        if required:
            raise CheckpointError(
                f"--resume: no complete checkpoint under {cfg.output_dir}/checkpoints"
            )
        return None
    trainer_state(path)
    return path
