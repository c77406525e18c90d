"""Checkpoints: an HF directory that from_pretrained loads, plus everything to resume.

Layout of output_dir/checkpoints/rollout_000010/:
  hf/                  config.json, model.safetensors, tokenizer files
  ds/                  DeepSpeed state: weights, optimizer and LR-scheduler (per rank)
  trainer_state.json   rollout, optimizer step, data position, non-finite step count
  rng_rank{r}.pt       python / torch (/ CUDA) RNG states of each rank
  COMPLETE             written last

A checkpoint is written into .tmp_rollout_XXXXXX, every file fsynced, the marker added,
then renamed into place (atomic on one file system). A run killed mid-save leaves only
a .tmp_ directory, which resume ignores and the next save removes.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from minisparse.grpo.distributed import barrier, rank

MARKER = "COMPLETE"
NAME = re.compile(r"^rollout_(\d{6})$")


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


def save_checkpoint(
    output_dir: str | Path, rollout: int, train_engine, tokenizer, trainer_state: dict[str, Any]
) -> Path:
    """Write checkpoint `rollout` atomically (all ranks call this); returns its path."""
    root = checkpoint_root(output_dir)
    final = root / f"rollout_{rollout:06d}"
    tmp = root / f".tmp_rollout_{rollout:06d}"
    if rank() == 0:
        for stale in root.glob(".tmp_rollout_*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
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
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    barrier()
    return final


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under output_dir, or None."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if NAME.match(p.name) and (p / MARKER).is_file()]
    return max(done, key=lambda p: int(NAME.match(p.name).group(1)), default=None)


def load_checkpoint(path: Path, train_engine) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and this rank's RNG; returns trainer_state."""
    load_path, _ = train_engine.load_checkpoint(
        str(path / "ds"), tag="state", load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the state in {path / 'ds'}")
    rng_file = path / f"rng_rank{rank()}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than were saved
        set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((path / "trainer_state.json").read_text())
