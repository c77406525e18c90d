"""Checkpoints: an HF directory that from_pretrained loads, plus everything to resume.

Layout of output_dir/checkpoints/rollout_000010/:
  hf/                  config.json, model.safetensors (16-bit weights), tokenizer files
  ds/                  DeepSpeed state per rank: fp32 master weights, Adam moments,
                       LR scheduler (under ZeRO 1/2 without a third copy of the weights)
  trainer_state.json   rollout, optimizer step, data position, non-finite step count
  rng_rank{r}.pt       python / torch (/ CUDA) RNG states of each rank
  COMPLETE             written last

A checkpoint is written into .tmp_rollout_XXXXXX, every file fsynced, the marker added,
then renamed into place (atomic on one file system). A run killed mid-save leaves only
a .tmp_ directory, which resume ignores and the next save removes. Checkpoints are
deleted the same way round: renamed to .del_rollout_XXXXXX first, then removed, so a
half-deleted one is never taken for a complete one. With save_total_limit N, a save
deletes older checkpoints only after the new one is complete, and keeps N in all.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from minisparse.trainer.distributed import barrier, rank, world_size

MARKER = "COMPLETE"
NAME = re.compile(r"^rollout_(\d{6})$")


class CheckpointError(RuntimeError):
    """A checkpoint this run cannot continue from (said before DeepSpeed touches it)."""


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _fsync_tree(path: Path) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _hf_state_dict(train_engine) -> dict[str, torch.Tensor] | None:
    """Full 16-bit weights (gathered under ZeRO 3; collective, so every rank calls it)."""
    if train_engine.zero_optimization_stage() == 3:
        return train_engine._zero3_consolidated_16bit_state_dict()
    return None  # save_pretrained reads the module's own (unsharded) weights


def _masters_hold_weights(train_engine) -> bool:
    """ZeRO 1/2 keep fp32 master weights in the optimizer state that DeepSpeed saves, and
    restore them on load; the 16-bit module weights are their rounded copy."""
    return train_engine.zero_optimization_stage() in (1, 2)


@contextmanager
def _module_weights_left_out(train_engine) -> Iterator[None]:
    """DeepSpeed writes the module's 16-bit weights into ds/ next to the fp32 masters, a
    third copy after hf/ (2 bytes per parameter of 16). Under ZeRO 1/2 leave parameters
    out of that file (buffers stay); load_checkpoint rebuilds them from the masters."""
    if not _masters_hold_weights(train_engine):
        yield
        return
    names = {n for n, _ in train_engine.module.named_parameters(remove_duplicate=False)}
    full_state_dict = train_engine.module_state_dict

    def without_parameters(*args, **kwargs):
        state = full_state_dict(*args, **kwargs)
        return type(state)((k, v) for k, v in state.items() if k not in names)

    train_engine.module_state_dict = without_parameters
    try:
        yield
    finally:
        del train_engine.module_state_dict  # the class's method again


def _number(path: Path) -> int:
    return int(NAME.match(path.name).group(1))


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints under output_dir, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if NAME.match(p.name) and (p / MARKER).is_file()]
    return sorted(done, key=_number)


def remove_checkpoint(path: Path) -> None:
    """Rename out of the way (atomic), then delete: no half-deleted 'complete' checkpoint."""
    doomed = path.with_name(f".del_{path.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    _fsync_dir(path.parent)
    shutil.rmtree(doomed)


def prune_checkpoints(output_dir: str | Path, keep: int | None, newest: Path) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep` (None: keep all); `newest`,
    the one just written, always stays, even when an older run left higher numbers.
    Returns the deleted paths."""
    if keep is None:
        return []
    if keep < 1:
        raise ValueError(f"save_total_limit must be >= 1 or None, got {keep}")
    others = [p for p in reversed(complete_checkpoints(output_dir)) if p != newest]
    doomed = others[keep - 1:]
    for path in doomed:
        remove_checkpoint(path)
    return doomed


def save_checkpoint(
    output_dir: str | Path,
    rollout: int,
    train_engine,
    tokenizer,
    trainer_state: dict[str, Any],
    keep: int | None = None,
) -> Path:
    """Write checkpoint `rollout` atomically (all ranks call this), then delete all but
    the newest `keep` complete ones; returns its path."""
    root = checkpoint_root(output_dir)
    final = root / f"rollout_{rollout:06d}"
    tmp = root / f".tmp_rollout_{rollout:06d}"
    if rank() == 0:
        for stale in [*root.glob(".tmp_rollout_*"), *root.glob(".del_rollout_*")]:
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    with _module_weights_left_out(train_engine):
        train_engine.save_checkpoint(str(tmp / "ds"), tag="state", save_latest=False)
    torch.save(rng_state(), tmp / f"rng_rank{rank()}.pt")
    state_dict = _hf_state_dict(train_engine)
    barrier()
    if rank() == 0:
        train_engine.module.save_pretrained(tmp / "hf", state_dict=state_dict)
        tokenizer.save_pretrained(tmp / "hf")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        _fsync_tree(tmp)
        (tmp / MARKER).write_text(f"rollout {rollout}\n")
        _fsync_tree(tmp)
        if final.exists():  # an older run's checkpoint of the same number
            remove_checkpoint(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        prune_checkpoints(output_dir, keep, final)
    barrier()
    return final


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under output_dir, or None."""
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None


def trainer_state(path: Path) -> dict[str, Any]:
    """trainer_state.json of checkpoint `path`, which this run's ranks can continue from
    (read before any model loads, and again by load_checkpoint)."""
    state = json.loads((path / "trainer_state.json").read_text())
    saved_world = state.get("world_size", world_size())
    if saved_world != world_size():
        raise CheckpointError(
            f"{path} was saved by {saved_world} processes and this run has {world_size()}: "
            f"ZeRO optimizer states are sharded per rank, so resume with "
            f"torchrun --nproc_per_node {saved_world} (or start a new output_dir)"
        )
    return state


def load_checkpoint(path: Path, train_engine) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and this rank's RNG; returns trainer_state."""
    state = trainer_state(path)
    masters = _masters_hold_weights(train_engine)
    load_path, _ = train_engine.load_checkpoint(
        str(path / "ds"),
        tag="state",
        load_module_strict=not masters,  # parameters left out (_module_weights_left_out)
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
    )
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the state in {path / 'ds'}")
    if masters:  # DeepSpeed restores the fp32 masters; round them into the module
        train_engine.optimizer.update_lp_params()
    rng_file = path / f"rng_rank{rank()}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than were saved
        set_rng_state(torch.load(rng_file, weights_only=False))
    return state
