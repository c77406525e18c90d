"""One run per output folder. Two runs writing one output_dir destroy each other's work:
the second's save removes the first's half-written checkpoint as stale, a checkpoint is
lost, metrics.jsonl interleaves both. So a run holds OUTPUT_DIR/.run.lock from before it
reads the folder (the checkpoint it resumes from) to its end, and a second run stops at
once, naming the holder.

The lock is the kernel's (flock on the open file): it goes when the process ends,
however it ends (exit, error, Ctrl-C, SIGTERM, SIGKILL, out of memory), so a dead run
never blocks a folder. The file also holds a JSON record of the holder (pid, host, start
time) for the message; a clean exit clears it, so a record found under a free lock was
left by a run that was killed, and the run taking over says so. Where flock does not
reach (a network file system without it), the record still stops a second run on the
same host while its holder lives (pid and the process's start time: a reused pid does
not count).

Under torchrun rank 0 takes the lock and tells the other ranks the outcome: the ranks of
one run share the folder and must not shut each other out. A folder whose run finished
says so without the lock (report.finished_message only reads), so nothing waits on it.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from minisparse.utils.distributed import all_gather_object, rank

LOCK_FILE = ".run.lock"
BUSY_READ_TRIES = 20  # a holder writes its record just after locking: up to 1 s for it
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


class RunLockError(RuntimeError):
    """output_dir cannot be this run's: not writable, another run's (the message says
    whose), or not lockable."""


def check_output_dir(path: str) -> None:
    """output_dir exists (made here) and takes a file: metrics, checkpoints and eval
    results all go there, and the first of them is written after a rollout."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise RunLockError(f"output_dir: cannot write to {path}: "
                             f"{exc.strerror or exc}") from None


def _process_start(pid: int) -> str | None:
    """Boot id and start tick of a running process (Linux /proc): a later process that
    reuses the pid has another. None where there is no /proc or no such process."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{boot}/{stat.rsplit(')', 1)[1].split()[19]}"  # field 22, after "(comm)"


@dataclass(frozen=True)
class Holder:
    """Who holds a folder, as its lock file records it."""

    pid: int
    host: str
    started: float  # time.time() when it took the lock
    process_start: str | None  # _process_start(pid) then

    @classmethod
    def me(cls) -> Holder:
        pid = os.getpid()
        return cls(pid, socket.gethostname(), time.time(), _process_start(pid))

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on host {self.host}, started {when}"

    def running_here(self) -> bool:
        """Still alive on this host (another host's process cannot be seen: False)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, another user's
            pass
        return self.process_start in (None, _process_start(self.pid))


def _read(fd: int) -> Holder | None:
    """The record in the lock file; None when empty or unreadable (being written)."""
    try:
        return Holder(**json.loads(os.pread(fd, 1 << 16, 0)))
    except (ValueError, TypeError):
        return None


def _write(fd: int, holder: Holder | None) -> None:
    os.ftruncate(fd, 0)
    if holder is not None:
        os.pwrite(fd, json.dumps(asdict(holder)).encode(), 0)
        os.fsync(fd)


def in_use_message(output_dir: str, holder: Holder | None) -> str:
    who = holder.describe() if holder else "its record is unreadable"
    return (f"{output_dir} is in use by another run ({who}); wait for it or choose another "
            f"output_dir")


def taken_over_message(output_dir: str, holder: Holder) -> str:
    return (f"{output_dir}: taking it over from a run that ended without releasing it "
            f"({holder.describe()})")


class RunLock:
    """output_dir's lock, held by this process from acquire() to release() or its exit."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.path = Path(output_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the folder; raises RunLockError while another run holds it. Returns the
        line to print when a killed run's record is taken over or the file system has
        no flock (None otherwise)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            note = self._lock(fd)
            previous = _read(fd)
            if previous is not None and previous.running_here():  # flock did not see it
                raise RunLockError(in_use_message(self.output_dir, previous))
            _write(fd, Holder.me())
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        atexit.register(self.release)
        if previous is not None:
            note = taken_over_message(self.output_dir, previous)
        return note

    def _lock(self, fd: int) -> str | None:
        """flock, or the note that the file system has none (the record still counts)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunLockError(in_use_message(self.output_dir, _busy_holder(fd))) from None
        except OSError as exc:
            if exc.errno not in NO_FLOCK:
                raise
            return (f"{self.path}: the file system cannot lock it ({exc.strerror}): a second "
                    f"run in this folder is stopped only from this host")
        return None

    def release(self) -> None:
        """Clear the record and unlock (a clean exit leaves no record); idempotent, and
        run at exit. Unlocked, not just closed: a forked child may share the file."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        atexit.unregister(self.release)
        try:
            _write(fd, None)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _busy_holder(fd: int) -> Holder | None:
    """The record of a held lock; a holder that has just locked may not have written its
    own yet (the file empty, or still a killed run's), so it is read again for a while."""
    holder = None
    for _ in range(BUSY_READ_TRIES):
        holder = _read(fd)
        if holder is not None and (holder.running_here() or
                                   holder.host != socket.gethostname()):
            break
        time.sleep(0.05)
    return holder


def hold_output_dir(output_dir: str) -> RunLock | None:
    """Rank 0 takes output_dir (made here if need be) for this run; every rank raises the
    same RunLockError when it cannot. Rank 0's lock, None on the other ranks."""
    check_output_dir(output_dir)
    lock, refused = None, None
    if rank() == 0:
        lock = RunLock(output_dir)
        try:
            note = lock.acquire()
        except RunLockError as exc:
            refused = str(exc)
        except OSError as exc:
            refused = f"output_dir: cannot lock {lock.path}: {exc.strerror or exc}"
        else:
            if note:
                print(note, flush=True)
    refused = all_gather_object(refused)[0]
    if refused is not None:
        raise RunLockError(refused)
    return lock
