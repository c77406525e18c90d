"""Telling a full disk from other failures of a save, and saying so in one line.

A checkpoint of a 7B model is about 100 GB over its ranks; a disk that fills during a
save used to end the run with a torch traceback deep inside DeepSpeed. The line names
what to free and where, and what a checkpoint needs.
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
NEARLY_FULL = 64 << 20  # bytes free after a failed write that mean the disk filled up


def ran_out_of_space(exc: BaseException, folder: Path) -> bool:
    """Whether a failed write ran out of space: ENOSPC or EDQUOT anywhere in the chain,
    or next to nothing left on the disk (torch.save reports a full disk as a
    RuntimeError that carries no errno)."""
    seen: BaseException | None = exc
    for _ in range(16):
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno in DISK_FULL:
            return True
        seen = seen.__cause__ or seen.__context__
    return shutil.disk_usage(folder).free < NEARLY_FULL


def mount_point(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


def human_size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} bytes"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def tree_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def disk_full_message(folder: Path, name: str, newest: Path | None) -> str:
    """One line: the checkpoint, the folder, the disk and its space, what a checkpoint
    takes (`newest`, the newest complete one), and that nothing complete was touched."""
    usage = shutil.disk_usage(folder)
    needs = f"; a checkpoint takes {human_size(tree_size(newest))}" if newest else ""
    return (f"disk full: checkpoint {name} could not be saved in {folder} (disk "
            f"{mount_point(folder)}: {human_size(usage.free)} free of "
            f"{human_size(usage.total)}{needs}); the complete checkpoints and metrics.jsonl "
            f"are intact: free space, then run the same command to resume")
