"""Helpers for tests that run train.py as a user would, in a subprocess."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path


def killed_after_rows(cmd: list[str], cwd: Path, env: dict[str, str], metrics: Path,
                      rows: int, timeout: float = 600) -> int:
    """Start cmd and SIGKILL it once `metrics` (a run's metrics.jsonl) holds `rows` rows,
    as a crash mid-run would; its return code."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= rows:
                proc.kill()
                break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.wait()
