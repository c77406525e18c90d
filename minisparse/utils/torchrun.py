"""The line a worker stopped with, for torchrun: written to the worker's error file
(TORCHELASTIC_ERROR_FILE, set by torchrun), whose message torchrun's failure report shows
in place of a link to its docs, and by which minisparse.launch knows that the worker has
said why it stopped."""
from __future__ import annotations

import json
import os
import time


def record_line(line: str) -> None:
    """Write `line` as this worker's error (under torchrun; nothing otherwise)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or not line:
        return
    data = {"message": {"message": line,
                        "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # the report falls back to its own text
        pass
