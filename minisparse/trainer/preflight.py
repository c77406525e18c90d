"""Checks a run makes before any model loads: everything it reads is there and parses,
and where it writes is writable. A typo or a bad data row then costs a second, not the
minutes a 7B model takes to load (or the rollouts run before eval or a save finds it).
Each failure is one line naming the thing; train.py prints it and exits 2.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from minisparse.compression import check_rule
from minisparse.config.schema import Config, ConfigError
from minisparse.data.benchmarks import load_benchmarks
from minisparse.data.datasets import check_data
from minisparse.data.left_out import LeftOut
from minisparse.data.synthetic import Difficulty
from minisparse.data.reward_plugin import load_reward_function
from minisparse.engine import check_backend
from minisparse.trainer.checkpoint import (CheckpointError, check_pickles, checkpoint_root,
                                           complete_checkpoints, remove_stale, trainer_state,
                                           usable_checkpoint, zero_mismatch)
from minisparse.utils.distributed import all_gather_object, rank
from minisparse.trainer.report import continue_command
from minisparse.trainer.run_config import record_config, settings_change
from minisparse.trainer.run_lock import RunLock, hold_output_dir
from minisparse.trainer.train_engine import unsupported_dtype
from minisparse.trainer.universal import refusal, saved_world_size
from minisparse.models.loading import check_model_path


class PreflightError(RuntimeError):
    """Something a run needs that is missing or unusable; the message names it."""


@dataclass
class Checked:
    """What the checks read that the run uses."""

    eval_problems: dict | None  # benchmark name -> problems, when in-training eval is on
    resume_from: Path | None  # the newest complete checkpoint, when the run resumes
    lock: RunLock | None = None  # output_dir held for this run (rank 0's)
    left_out: LeftOut | None = None  # the data's rows, and those no run can train on


def check_run(cfg: Config, world: int, resume_required: bool) -> Checked:
    """Every check, cheapest first; raises on the first failure."""
    check_world(cfg, world)
    check_backend(cfg)
    check_rule(cfg.compress)
    check_model_path(cfg.model.path)
    left_out = check_data(cfg.data)
    if rank() == 0 and (line := left_out.line()):
        print(line, flush=True)
    if cfg.reward.function:
        load_reward_function(cfg.reward.function)
    if why := unsupported_dtype(cfg.model.dtype):
        raise PreflightError(f"model.dtype={cfg.model.dtype}: {why}")
    lock = hold_output_dir(cfg.output_dir)  # this run's alone from here to its exit
    try:
        return _check_with_folder_held(cfg, world, resume_required, left_out, lock)
    except BaseException:  # a run that stops here leaves the folder free at once
        if lock is not None:
            lock.release()
        raise


def _check_with_folder_held(cfg: Config, world: int, resume_required: bool,
                            left_out: LeftOut, lock: RunLock | None) -> Checked:
    """What the held output_dir holds (stale temporary folders, the checkpoint to resume
    from), then the evaluation benchmarks."""
    if rank() == 0:
        clear_stale(cfg.output_dir)
    resume_from = resume_checkpoint(cfg, resume_required, left_out.usable)
    check_reshard(cfg, resume_from, world)
    if rank() == 0:  # what this run trains with, from here on the folder's (run_config.py)
        record_config(cfg)
    problems = None
    if cfg.eval_interval:
        problems = load_benchmarks(cfg.eval.benchmarks, cfg.eval.data_dir, cfg.eval.limit,
                                   Difficulty.from_config(cfg.data))
    return Checked(eval_problems=problems, resume_from=resume_from, lock=lock,
                   left_out=left_out)


def check_world(cfg: Config, world: int) -> None:
    """Batch keys must split evenly over the ranks."""
    for key in ("rollout_batch_size", "global_batch_size"):
        if getattr(cfg, key) % world:
            raise ConfigError(
                f"config key '{key}' ({getattr(cfg, key)}) must be divisible "
                f"by the number of processes ({world})"
            )


def check_reshard(cfg: Config, path: Path | None, world: int) -> None:
    """A checkpoint of another number of ranks continues, resharded (trainer/universal.py),
    except under ZeRO 3; one saved under ZeRO continues under ZeRO only, one saved without
    it only without: refused here, before any model loads."""
    if path is not None:
        if why := refusal(cfg.zero_stage, saved_world_size(trainer_state(path), world),
                          world):
            raise CheckpointError(f"checkpoint {path} {why}")
        if why := zero_mismatch(path, cfg.zero_stage):
            raise CheckpointError(why)


def clear_stale(output_dir: str) -> None:
    """Remove what a save or delete cut short left behind (a crash, a full disk): the
    space goes back before this run saves. The caller holds output_dir (run_lock.py)."""
    if stale := remove_stale(output_dir):
        print(f"removed {', '.join(stale)} from {checkpoint_root(output_dir)}: left by an "
              f"interrupted save", flush=True)


T = TypeVar("T")


def decided_on_rank_0(decide: Callable[[], T]) -> T:
    """decide() run by rank 0 alone, its result (or CheckpointError) handed to every rank:
    all ranks go on with the same answer or stop with the same line."""
    outcome: Any = None
    if rank() == 0:
        try:
            outcome = decide()
        except CheckpointError as exc:
            outcome = exc
    outcome = all_gather_object(outcome)[0]
    if isinstance(outcome, CheckpointError):
        raise outcome
    return outcome


def resume_checkpoint(cfg: Config, required: bool, data_rows: int) -> Path | None:
    """The checkpoint the run continues from (--resume requires one; resume=auto takes one
    if there is; never: none): the newest complete one under output_dir that matches its
    manifest (a damaged one is named and the one before it taken), whose pickled files
    hold plain data only, and whose data order this run can continue. Rank 0 chooses (it
    hashes the checkpoint: manifest.py gives the cost) and every rank gets its choice."""
    if not required and cfg.resume == "never":
        return None

    def choose() -> Path | None:
        path = usable_checkpoint(cfg.output_dir, required)
        if path is not None:
            check_pickles(path, older_checkpoint(cfg, path))
            check_data_order(cfg, path, data_rows)
            if why := settings_change(cfg):  # a resume must not go on with another algorithm
                raise CheckpointError(why)
        return path

    return decided_on_rank_0(choose)


def older_checkpoint(cfg: Config, refused: Path) -> str:
    """What to do about a checkpoint refused as unsafe: resume from the complete one
    before it, with the command that does (the refused one moved aside, out of resume's
    sight), or start in a new output_dir."""
    older = [p for p in complete_checkpoints(cfg.output_dir) if p.name < refused.name]
    if not older:
        return "no complete checkpoint before it to resume from: give a new output_dir"
    aside = refused.with_name(f"refused_{refused.name}")
    return (f"the previous complete checkpoint is {older[-1].name}; to resume from it: "
            f"mv {refused} {aside} && {continue_command(cfg)}")


def _setting(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool) else str(value)


def check_data_order(cfg: Config, path: Path, data_rows: int) -> None:
    """Checkpoint `path` continues this run's prompt order: same seed and data.shuffle,
    and no more prompts than the data has rows. It may have fewer (prompts over
    max_prompt_len are dropped once tokenized): train.py's resume compares those exactly,
    after the model loads."""
    saved = trainer_state(path).get("sampler")
    if not isinstance(saved, dict):
        return
    for key, setting, now in (("seed", "seed", cfg.seed), ("shuffle", "data.shuffle",
                                                         cfg.data.shuffle)):
        if key in saved and saved[key] != now:
            raise CheckpointError(
                f"checkpoint {path.name} was trained with {setting}={_setting(saved[key])} and "
                f"this run has {setting}={_setting(now)}: its prompt order would change; "
                f"resume with --set {setting}={_setting(saved[key])} or give a new output_dir")
    if saved.get("num_rows", 0) > data_rows:
        data = ("data.synthetic_size" if cfg.data.path == "synthetic"
                else f"data.path {cfg.data.path}")
        raise CheckpointError(
            f"checkpoint {path.name} was trained on {saved['num_rows']} prompts and this "
            f"run's data ({data}) has {data_rows}: the data set changed; resume with the "
            f"data it was trained on or give a new output_dir")
