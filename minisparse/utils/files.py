"""Atomic file writes: a file is written under a temporary name beside it and renamed over
it once complete, so a reader (or a run resumed after a kill) sees the old file or the new
one, never half of one."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


@contextmanager
def atomic_write(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """The open temporary file (mode "w": UTF-8 text, "wb": bytes) for the block; renamed
    over `path` when the block ends, removed when it raises. Its name (`.name`) is known
    in the block, for a check of what was written before it takes `path`'s place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from other users
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
