"""Stopping on SIGTERM and Ctrl-C (SIGINT) in any phase, within seconds, keeping the state
of the last completed update, without a traceback.

- During set-up (before the first rollout) a stop signal ends the run at once: nothing
  is saved yet, and a big model's loading must not go on for half an hour.
- During training a stop keeps the state as of the last completed update: a rollout,
  reward or log-prob pass under way (or an evaluation) is dropped, an update under way
  finishes first. train.py saves that state unless a checkpoint holds it already (the
  data position and random state go back to the dropped rollout's start, so the resumed
  run redoes that rollout exactly) and exits: 0 after a SIGTERM (a scheduler's or
  `timeout`'s: the stop it asked for went well), 130 after a Ctrl-C, as a shell reports
  one. The same command resumes.
- Under torchrun a stop one rank gets is posted to all through the store (peers.py), so
  every rank stops in the same rollout. A rank never leaves a collective half done
  (`uncut`, utils/distributed.py): a stop waits for the collective under way, or takes
  the rank out of the meet before it.
- STOP_LIMIT_S after the first signal, a process that has not stopped (a peer gone, a
  collective stuck) is ended with one line saying nothing more was saved, unless an
  update or a save is under way while every rank is alive. A watchdog thread sees each
  signal as it arrives (signal.set_wakeup_fd), also while the main thread is blocked in
  a collective, where Python's handler cannot run.
- A second signal ends the process at once (exit 128 + signal), unless it comes within
  ECHO_S of the first: torchrun passes the terminal's Ctrl-C (or a scheduler's SIGTERM) on
  to workers that already got it, and that echo must not cut the stop short.
"""
from __future__ import annotations

import _thread
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

import torch

from minisparse.utils import distributed as dist

ECHO_S = 1.0  # a repeat of the signal this soon after the first is a launcher's echo
STOP_LIMIT_S = 15.0  # a stop not done by then ends the process, saying so
SIGNALS = (signal.SIGTERM, signal.SIGINT)
NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}
# What a stop signal does, by where the run is.
SETUP, DROP, FINISH, STOPPING = "setup", "drop", "finish", "stopping"


class Interrupted(BaseException):
    """Raised in the main thread by a stop that ends set-up or drops a phase. A
    BaseException, like KeyboardInterrupt, so that no `except Exception` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(NAMES.get(signum, str(signum)))
        self.signum = signum


class StopOnSignal:
    """Handlers for SIGTERM and SIGINT, and the state they act on: `droppable()` marks a
    block a stop drops, `commit()` its end once every rank is through it (the update
    follows), `requested()` whether any rank asked for a stop (after an update; every rank
    calls it at the same point), `stopping()` the stop itself under way."""

    def __init__(self, speak: bool = True) -> None:
        self.speak = speak
        self.state = SETUP
        self.signum: int | None = None  # the stop asked for, by a signal here or a peer's
        self.pending = False  # asked while it could not act (a collective, an update)
        self.depth = 0  # uncut blocks under way
        self.saving = False
        self.notice = ""  # said when a stop waits for the update under way
        self.noticed = False
        # the line of a process that could not stop in time: (signal, why) -> line
        self.stuck_line: Callable[[int, str], str] = lambda signum, why: ""
        self.previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        self.watchdog = Watchdog(self)
        dist.set_guard(self)

    # -------------------------------------------------------------- the handlers

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        self._act()

    def _act(self) -> None:
        """What the stop asked for does here and now."""
        if self.signum is None or self.state == STOPPING:
            return
        if self.depth:  # a collective or a swap under way: after it
            self.pending = True
            return
        if self.state in (SETUP, DROP):
            self.stopping()
            raise Interrupted(self.signum)
        self.pending = True  # FINISH: the update under way ends first
        if not self.noticed:
            self.noticed = True
            self.say(self.notice.format(signal=NAMES[self.signum]))

    def peer_stop(self, signum: int) -> None:
        """A stop posted by a rank (from the heartbeat thread, or the main thread's wait
        in a meet): the same as the signal arriving here, without counting as one."""
        self.watchdog.begin()
        if self.signum is None and threading.current_thread() is threading.main_thread():
            self.signum = signum
            self._act()  # pending: in a meet, an uncut block
        elif self.signum is None:
            self.watchdog.expect_echo(signum)
            _thread.interrupt_main(signum)  # runs _handle in the main thread

    def say(self, line: str) -> None:
        """One line on stdout. Written to the file descriptor, unbuffered: the handler
        may run while the main thread is in the middle of a print, and a second write
        into the same buffered stream would raise."""
        if self.speak and line:
            os.write(sys.stdout.fileno(), (line + "\n").encode())

    # ------------------------------------------------------- where the run is

    def training(self, notice: str) -> None:
        """Set-up is over. `notice`: said when a stop waits for an update ({signal})."""
        self.state, self.notice = FINISH, notice

    @contextmanager
    def droppable(self) -> Iterator[None]:
        """A block a stop drops (raising Interrupted), at once if one was asked before."""
        if self.state != STOPPING:
            self.state = DROP
            self._act()
        try:
            yield
        finally:
            if self.state == DROP:
                self.state = FINISH

    def commit(self) -> None:
        """The end of a droppable block, at which the ranks meet: a stop before every
        rank is here drops the block on all; after, the update runs on all, then stops."""
        def all_in() -> None:
            dist.device_barrier()
            self.state = FINISH  # before the uncut block ends and a pending stop acts

        if dist.is_distributed():
            dist.together(all_in)
        elif self.state == DROP:
            self.state = FINISH

    def requested(self) -> bool:
        """Whether any rank was asked to stop (a collective: every rank calls it)."""
        flag = torch.tensor([float(self.signum is not None)])
        return bool(dist.all_reduce(flag, op="max").item() > 0)

    def stopping(self) -> None:
        """The stop itself is under way: further signals wait for it (a second one, past
        ECHO_S, ends the process), and the ranks meet apart from meets before it."""
        self.state, self.pending = STOPPING, False
        if (peers := dist.peers()) is not None:
            peers.stopping()

    @contextmanager
    def saving_now(self) -> Iterator[None]:
        """A save: the watchdog lets it finish while every rank is alive."""
        self.saving = True
        try:
            yield
        finally:
            self.saving = False

    # ------------------------------------------------- utils.distributed's Guard

    @contextmanager
    def uncut(self) -> Iterator[None]:
        """A block a stop does not cut in two (a collective with its meet, a memory swap):
        a stop asked meanwhile acts when it ends, or leaves the meet (`leaving`)."""
        self.depth += 1
        try:
            yield
        except Interrupted:  # left a meet: the stop is under way
            self.stopping()
            raise
        finally:
            self.depth -= 1
        if not self.depth and self.pending:
            self._act()

    def leaving(self) -> BaseException | None:
        """The exception with which to leave a meet: a stop asked in a droppable block."""
        if self.pending and self.state == DROP and self.signum is not None:
            return Interrupted(self.signum)
        return None

    # ------------------------------------------------------------------ watchdog

    def overdue(self) -> None:
        """STOP_LIMIT_S after the stop began: more time while an update or a save goes on
        with every rank alive; else end the process, saying so."""
        peers = dist.peers()
        # a live rank beats every interval: two missed beats and more are not a slow save
        alive = peers is None or (peers.lost is None
                                  and peers.silent_s() < 2 * peers.interval + 1)
        if alive and (self.saving or self.state == FINISH):
            self.watchdog.extend(5.0)
            return
        signum = self.signum or signal.SIGTERM
        if peers is not None and peers.lost is not None:
            why = f"{peers.lost.who()} {peers.lost.why}"
        elif not alive:
            why = peers.quietest()
        else:
            why = ("the operation under way (a collective, or one long computation) did not "
                   "return")
        dist.exit_now(self.stuck_line(signum, why), 128 + signum, self.speak, out=1)

    def close(self) -> None:
        """Give the signals back to the handlers that were there before."""
        self.watchdog.close()
        dist.set_guard(None)
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)


class Watchdog:
    """Reads every signal as it arrives (signal.set_wakeup_fd writes its number to a
    socket from C, whatever the main thread is doing): a second one ends the process,
    and a stop that takes too long is handed to StopOnSignal.overdue()."""

    def __init__(self, owner: StopOnSignal) -> None:
        self.owner = owner
        self.reader, writer = socket.socketpair()
        writer.setblocking(False)
        self.writer = writer
        self.previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self.first: float | None = None
        self.deadline: float | None = None
        self.echoes: list[int] = []  # signal numbers interrupt_main wrote for a peer's stop
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="stop-watchdog", daemon=True)
        self.thread.start()

    def begin(self) -> None:
        with self.lock:
            if self.deadline is None:
                self.deadline = time.monotonic() + STOP_LIMIT_S

    def extend(self, seconds: float) -> None:
        with self.lock:
            self.deadline = time.monotonic() + seconds

    def expect_echo(self, signum: int) -> None:
        with self.lock:
            self.echoes.append(signum)

    def _run(self) -> None:
        while True:
            with self.lock:
                wait = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            ready, _, _ = select.select([self.reader], [], [], wait)
            if not ready:
                self.owner.overdue()
                continue
            data = self.reader.recv(64)
            if not data:  # closed
                return
            for signum in data:
                self._signal(signum)

    def _signal(self, signum: int) -> None:
        if signum not in SIGNALS:
            return
        with self.lock:
            if signum in self.echoes:
                self.echoes.remove(signum)
                return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.begin()
            if (peers := dist.peers()) is not None:
                try:
                    peers.post_stop(signum)
                except Exception:  # the store is gone: this rank stops alone
                    pass
        elif now - self.first >= ECHO_S:
            os._exit(128 + signum)  # a second one: at once, nothing more said

    def close(self) -> None:
        signal.set_wakeup_fd(self.previous_fd)
        self.writer.close()  # the reader sees the end
        self.thread.join(timeout=5)
        self.reader.close()
