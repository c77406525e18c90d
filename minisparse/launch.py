"""torchrun, reporting a failed run as train.py alone reports it: its one line last and
its exit code (2 for bad input, 1 for a failure, 128 + N for signal N), instead of
torchrun's log lines, its traceback and exit code 1.

    python -m minisparse.launch --nproc_per_node 2 train.py --config qwen3b_rkv

It takes torchrun's arguments and runs torchrun's own launch (torch.distributed.run).
A worker that stops with a line of its own also writes it to torchrun's error file
(utils/distributed.py): the line is then already the last thing on the terminal, and
nothing is added. Otherwise (a worker killed by a signal, or one that printed a
traceback) one line names the first rank that failed and how.
"""
from __future__ import annotations

import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def exit_code(code: int) -> int:
    """A worker's exit code as a shell reports it: 128 + N for signal N."""
    return 128 - code if code < 0 else code


def failure_line(exc: ChildFailedError) -> str | None:
    """None when a failed worker wrote its own line (torchrun's error file); else one line
    on the first failure."""
    if any(isinstance(f.message, dict) for f in exc.failures.values()):
        return None
    rank, first = exc.get_first_failure()
    if first.exitcode < 0:
        how = f"was killed by {signal.Signals(-first.exitcode).name}"
    else:
        how = f"exited with status {first.exitcode} (its output above says why)"
    return f"error: rank {rank} (pid {first.pid}) {how}"


def main(argv: list[str] | None = None) -> int:
    # torchrun's agent logs each step of a failure (which ranks it stops, with which
    # signal, which failed): the workers' own lines say what matters
    for name in ("torch.distributed.elastic", "torch.distributed.run",
                 "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        if line := failure_line(exc):
            print(line, file=sys.stderr, flush=True)
        return exit_code(exc.get_first_failure()[1].exitcode)
    except SignalException as exc:  # passed on to the workers, who said how they stopped
        return 128 + exc.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main())
