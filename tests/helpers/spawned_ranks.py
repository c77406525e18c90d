"""The process group of a rank that a test starts with torch.multiprocessing.spawn."""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def spawned_rank(rank: int, world: int, init_file: str, backend: str = "gloo") -> Iterator[None]:
    """init_process_group for one spawned rank, then a teardown no rank dies of; the
    process ends with the block (os._exit), so only a spawned worker may use it.

    Why: a rank whose gloo group went down while another rank's last message was still on
    its way aborted ("terminate called without an active exception", SIGABRT), about one
    full-suite run in four for one such test, and a finished rank could abort the same way
    in the interpreter's teardown, where C++ threads of torch or gloo still ran. So each
    rank waits past a barrier until every rank is past it (files beside init_file), tears
    its group down and exits at once. An exception in the block skips all but the
    teardown and reaches spawn as the rank's failure."""
    import torch.distributed as tdist

    tdist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                             world_size=world)
    try:
        yield
        tdist.barrier()
        Path(f"{init_file}.past{rank}").touch()
        deadline = time.monotonic() + 120
        while not all(Path(f"{init_file}.past{r}").exists() for r in range(world)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: another rank never got past the barrier")
            time.sleep(0.01)
    finally:
        tdist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
