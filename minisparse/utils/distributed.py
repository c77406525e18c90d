"""torch.distributed helpers that work single-process, with gloo (CPU) and nccl (GPU),
and how a metric combines over ranks.

NCCL only reduces CUDA tensors and gloo only CPU ones; these helpers move the tensor to
the backend's device and back, so callers never branch on the backend.

Under torchrun the ranks watch each other through the rendezvous store (peers.py), and
each of these collectives first meets the other ranks there: a rank that is done first
waits in the store for as long as the others are alive, and the collective itself gets
dist.timeout_s (minutes), not hours. A stop signal never cuts a collective in two
(`Guard`, trainer/stop.py): it takes effect before the meet completes or after the
collective returns.

A metric's reduction over ranks is carried by its value where the metric is made, so
renaming a metric cannot change it: Sum for counts, Max for maxima, a plain float for
metrics averaged over ranks. Both are floats (they log and compare as floats).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, ContextManager, NoReturn, Protocol, TypeVar

import torch
import torch.distributed as dist

from minisparse.utils.peers import Loss, Peers
from minisparse.utils.torchrun import record_line

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Guard(Protocol):
    """How a stop signal meets the collectives: trainer/stop.py's StopOnSignal."""

    def uncut(self) -> ContextManager[None]:
        """A block (a collective with its meet) that a stop must not cut in two."""

    def leaving(self) -> BaseException | None:
        """The exception with which this rank leaves a meet (a stop), or None."""

    def peer_stop(self, signum: int) -> None:
        """Another rank (or this one) posted a stop for all."""


class _NoGuard:
    def uncut(self) -> ContextManager[None]:
        return nullcontext()

    def leaving(self) -> BaseException | None:
        return None

    def peer_stop(self, signum: int) -> None:
        pass


_peers: Peers | None = None
_guard: Guard = _NoGuard()
_on_lost: Callable[[Loss], None] | None = None


def on_peer_lost(callback: Callable[[Loss], None]) -> None:
    """What a rank does once a peer is lost (called from the heartbeat thread): print a
    line and end the process (exit_now). Before any: a plain line, exit 1."""
    global _on_lost
    _on_lost = callback


def peers() -> Peers | None:
    """This rank's view of the others (None single-process)."""
    return _peers


def set_guard(guard: Guard | None) -> None:
    global _guard
    _guard = guard or _NoGuard()


def init_distributed(timeout_s: float = 600.0, peer_timeout_s: float = 120.0) -> torch.device:
    """Start the process group (nccl with GPUs, gloo without) and pick this rank's device;
    under torchrun, also the heartbeat through its store (peers.py).

    Under torchrun the launcher's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT stand.
    Without it (one process, and DeepSpeed still needs an initialised group) the group
    meets in an in-process store instead of on a TCP port, so any number of single-process
    runs share a machine (a fixed default port made the second one fail with EADDRINUSE);
    a MASTER_PORT set by hand is still used. `timeout_s` bounds each collective once all
    ranks have met (dist.timeout_s); `peer_timeout_s` is how long a rank may go without a
    heartbeat (dist.peer_timeout_s).
    """
    single = os.environ.get("WORLD_SIZE", "1") == "1" and "MASTER_PORT" not in os.environ
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if single:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            dist.init_process_group(backend, timeout=timeout)
        _watch_peers(peer_timeout_s)
    return device


def _watch_peers(timeout_s: float) -> None:
    global _peers
    if dist.get_world_size() > 1:
        store = dist.distributed_c10d._get_default_store()
        _peers = Peers(store, dist.get_rank(), dist.get_world_size(), timeout_s)
        _peers.on_stop = lambda signum: _guard.peer_stop(signum)
        _peers.on_lost = _lost
        _peers.start()


def _lost(loss: Loss) -> None:
    if _on_lost is not None:
        _on_lost(loss)
    exit_now(f"error: {loss.who()} {loss.why}; the run stopped", 1, speaks_after(loss))


def blame_peer(exc: BaseException) -> None:
    """After a collective failed (a peer killed: gloo's 'Connection closed by peer'), give
    the heartbeat the time to tell which peer it was: it then ends the process with its
    line instead of this traceback. Returns when no peer is lost, or exc is another error."""
    if _peers is None or not broken_collective(exc):
        return
    _peers.suspect()
    deadline = time.monotonic() + _peers.threshold + 2 * _peers.interval + 1
    while time.monotonic() < deadline and _peers.lost is None:
        time.sleep(0.1)
    while _peers.lost is not None:  # the heartbeat thread is ending the process
        time.sleep(1)


def broken_collective(exc: BaseException) -> bool:
    """Whether exc is a collective's failure (gloo, NCCL, a closed connection)."""
    text = str(exc)
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and any(
        word in text for word in ("gloo", "NCCL", "Connection closed", "Connection reset")))


def speaks_after(loss: Loss) -> bool:
    """Whether this rank is the one to say that a peer was lost: the lowest rank left;
    with the store gone, the first of each node (it may be all that is left)."""
    if loss.rank is None:
        return os.environ.get("LOCAL_RANK", "0") == "0"
    return rank() == min(r for r in range(world_size()) if r != loss.rank)


def leave(why: str) -> None:
    """Tell the other ranks why this one leaves (peers.FINISHED at a run's end) and stop
    the heartbeat; a no-op single-process or when the store is gone too."""
    global _peers
    watch, _peers = _peers, None
    if watch is None:
        return
    try:
        watch.leave(why)
    except Exception:  # the store went with rank 0's node: nobody is left to tell
        pass
    watch.close()


_exiting = threading.Lock()


def exit_now(line: str, code: int, speak: bool, out: int = 2) -> NoReturn:
    """Print `line` (if `speak`), abort the process groups and end the process with
    `code`, from any thread: the main thread may be stuck in a collective whose peer is
    gone, where nothing else ends it. The line goes to file descriptor `out` (stderr; 1:
    stdout) and to torchrun's error file, so that its failure report shows it. The first
    caller wins; any other waits for the end."""
    if not _exiting.acquire(blocking=False):
        while True:
            time.sleep(60)
    if speak and line:
        os.write(out, (line + "\n").encode())
    record_line(line)
    aborter = threading.Thread(target=_abort, daemon=True)
    aborter.start()
    aborter.join(timeout=5)  # NCCL's abort may hang on a dead peer: the exit does not wait
    os._exit(code)


def _abort() -> None:
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception:  # gloo has no abort: the exit closes its sockets
        pass


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def together(collective: Callable[[], T]) -> T:
    """Run `collective` once every rank has met in the store (peers.meet), as one block a
    stop signal does not cut (the guard)."""
    with _guard.uncut():
        if _peers is not None:
            _peers.meet(_guard.leaving)
        return collective()


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduced copy of tensor over all ranks (sum | max | min); identity single-process."""
    if not is_distributed():
        return tensor
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    work = tensor.detach().to(_comm_device()).clone()
    together(lambda: dist.all_reduce(work, op=ops[op]))
    return work.to(tensor.device)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable obj, in rank order; [obj] single-process."""
    if not is_distributed():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    together(lambda: dist.all_gather_object(gathered, obj))
    return gathered


def device_barrier() -> None:
    """dist.barrier on this rank's GPU under NCCL: named, NCCL need not guess the device
    (and warn that it did, once per barrier, in every run's log)."""
    device = _comm_device()
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def barrier() -> None:
    if is_distributed():
        together(device_barrier)


class Sum(float):
    """A count: added up over ranks."""


class Max(float):
    """A maximum: the largest value over ranks."""
