"""Helpers for tests that run train.py as a user would, in a subprocess."""
from __future__ import annotations

import signal
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from scripts.ports import free_ports

# train.py as __main__, its metrics logger sending the process SIGNUM (once) as
# metrics.jsonl reaches ROWS rows: right after that row is written, however busy the
# machine (a poller outside lands later by however long it waits to run, and may miss
# the run's end).
SIGNAL_AFTER_ROWS = """\
import os, runpy, sys
from minisparse.trainer.logger import MetricsLogger

rows, signum, log, sent = int(sys.argv[1]), int(sys.argv[2]), MetricsLogger.log, []

def log_then_signal(self, rollout, metrics):
    log(self, rollout, metrics)
    if not sent and len(self.path.read_text().splitlines()) >= rows:
        sent.append(signum)
        os.kill(os.getpid(), signum)

MetricsLogger.log = log_then_signal
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def signalled_after_rows(cmd: list[str], cwd: Path, env: dict[str, str], rows: int,
                         signum: int = signal.SIGKILL,
                         timeout: float = 600) -> subprocess.CompletedProcess:
    """Run cmd (python train.py ...), which gets `signum` as its metrics.jsonl reaches
    `rows` rows (SIGKILL: as a crash mid-run would); the finished process, its output
    captured."""
    python, *args = cmd
    return subprocess.run([python, "-c", SIGNAL_AFTER_ROWS, str(rows), str(int(signum)),
                           *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


@contextmanager
def port_in_use() -> Iterator[int]:
    """A free port, listened on for the block (another run holding it)."""
    with socket.socket() as taken:
        port = free_ports()
        taken.bind(("", port))
        taken.listen()
        yield port
