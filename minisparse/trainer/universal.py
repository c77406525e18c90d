"""Resuming a checkpoint on another number of processes than wrote it.

ZeRO 1/2 save the fp32 master weights and Adam moments as one flat shard per rank, cut
where the saving world's partition boundaries fell, so a checkpoint of N ranks does not
load as is into M. DeepSpeed's universal checkpoint undoes the cut: ds_to_universal
merges the N shards into one folder per parameter (fp32, exp_avg, exp_avg_sq, step), and
an engine loading with `checkpoint.load_universal` takes from each the slice its own
partition holds, for any M. The LR scheduler and the step counters come from the
model-state file, as in a plain load.

The conversion goes to a temporary folder beside the checkpoint (the file system every
rank already saves to; named .tmp_rollout_*, so a copy left by a kill is cleared at the
next start or save, as a torn save is): rank 0 converts, all ranks load, rank 0 removes
it. The saved checkpoint is only read.

ZeRO 0 holds the optimizer whole and loads on any number of ranks as saved. ZeRO 3's
universal load ran but continued 2.5e-5 away from an uninterrupted run after one step
(ZeRO 1/2: 2e-8), so a world-size change under ZeRO 3 is refused. The data order needs
nothing here: PromptSampler's global batches do not depend on the world size, and each
rank of the new world takes its slice. Ranks the saving run did not have find no RNG
file and keep the state setup() seeded (seed + rank).
"""

from __future__ import annotations

import argparse
import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from minisparse.utils.quiet import hidden_bars, hidden_prints
from minisparse.utils.distributed import all_gather_object, barrier, rank, world_size

TAG = "state"  # the DeepSpeed tag checkpoint.py saves under ds/
RESHARDED_STAGES = (1, 2)  # ZeRO 0 needs no resharding; ZeRO 3's is refused (above)


def saved_world_size(state: dict[str, Any], world: int) -> int:
    """The number of processes that wrote a checkpoint (trainer_state.json without it:
    `world`, this run's, as before resharding existed)."""
    return int(state.get("world_size", world))


def _processes(n: int) -> str:
    return f"{n} process{'es' if n != 1 else ''}"


def refusal(zero_stage: int | str, saved: int, world: int) -> str | None:
    """Why a checkpoint of `saved` ranks cannot continue on `world` ranks under
    zero_stage (auto is 1 or 2), or None when it can."""
    if saved == world or zero_stage != 3:
        return None
    return (f"was saved by {_processes(saved)} and this run has {world}: resharding ZeRO 3 "
            f"state is not supported, so resume with torchrun --nproc_per_node {saved} "
            f"or zero_stage 1 or 2")


def reshard_line(path: Path, saved: int, world: int) -> str:
    """The one line a resharded resume prints, naming the ranks whose RNG starts fresh."""
    line = (f"checkpoint {path} was written by {_processes(saved)} and is resharded for "
            f"{world} (DeepSpeed universal checkpoint)")
    if world == saved + 1:
        line += f"; rank {saved} had no RNG state saved and starts from a fresh one (seed + rank)"
    elif world > saved:
        line += (f"; ranks {saved}-{world - 1} had no RNG state saved and start from fresh "
                 f"ones (seed + rank)")
    return line


def _resharded_from(path: Path, state: dict[str, Any], train_engine) -> int | None:
    """The saving world's size where loading checkpoint `path` needs the universal copy
    (it differs from this one's under ZeRO 1/2), else None."""
    world, stage = world_size(), train_engine.zero_optimization_stage()
    saved = saved_world_size(state, world)
    if why := refusal(stage, saved, world):
        raise RuntimeError(f"checkpoint {path} {why}")  # preflight refuses it first
    return saved if saved != world and stage in RESHARDED_STAGES else None


def _convert(ds_dir: Path, out: Path) -> None:
    """ds_to_universal in this process, without its worker pool: it runs inside a
    torchrun rank whose process group (and CUDA context) a fork would copy."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=str(ds_dir), output_folder=str(out), num_extract_workers=1,
        num_merge_workers=1, keep_temp_folder=False, strict=True,
        inject_missing_state=True,  # our model records no universal-checkpoint info
    )
    with hidden_prints(False), hidden_bars(False):
        ds_to_universal.main(args)


def _converted_on_rank0(path: Path, folder: Path) -> None:
    """Rank 0 converts while the others wait; a failure reaches every rank (raised on
    all), so none is left waiting at a barrier for a copy that will not come."""
    error = None
    if rank() == 0:
        try:
            shutil.rmtree(folder, ignore_errors=True)
            _convert(path / "ds" / TAG, folder / TAG)
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            error = f"{type(exc).__name__}: {exc}"
    if error := all_gather_object(error)[0]:
        raise RuntimeError(f"converting {path / 'ds'} to a universal checkpoint failed: {error}")


@contextmanager
def universal_copy(path: Path) -> Iterator[Path]:
    """Checkpoint `path`'s DeepSpeed state as a universal checkpoint for the time of the
    block, beside it; yields the load_dir (tag TAG). Removed once every rank has loaded."""
    folder = path.parent / f".tmp_{path.name}_universal"
    try:
        _converted_on_rank0(path, folder)
        yield folder
        barrier()
    finally:
        if rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)


class _NoTensorParallelNote(logging.Filter):
    """DeepSpeed warns on every rank that a universal load found no tensor-parallel
    layout (mpu); we have none, so the warning says nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "MPU is not provided" not in record.getMessage()


@contextmanager
def loading_universal(train_engine) -> Iterator[None]:
    """The engine reads the universal layout for this one load. DeepSpeed takes
    `checkpoint.load_universal` from its config at initialize but consults it only when
    loading, so the engine is built as for any run and switched here."""
    from deepspeed.utils import logger

    config, note = train_engine._config, _NoTensorParallelNote()
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    logger.addFilter(note)
    try:
        yield
    finally:
        config.load_universal_checkpoint = before
        logger.removeFilter(note)


@contextmanager
def deepspeed_state(path: Path, state: dict[str, Any], train_engine) -> Iterator[Path]:
    """The folder to hand train_engine.load_checkpoint (tag TAG) for checkpoint `path`:
    its own ds/, or where the world size changed under ZeRO 1/2, its universal copy with
    the engine set to read it, and the one line that says so (rank 0)."""
    saved = _resharded_from(path, state, train_engine)
    if saved is None:
        yield path / "ds"
        return
    if rank() == 0:
        print(reshard_line(path, saved, world_size()), flush=True)
    with universal_copy(path) as folder, loading_universal(train_engine):
        yield folder
