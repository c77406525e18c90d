"""Stopping on SIGTERM and Ctrl-C (SIGINT) at any phase, within seconds, without a traceback.

- During set-up (before the first rollout) either signal stops the run at once: there is
  nothing to save yet, and a big model's loading must not go on for half an hour.
- During training a SIGTERM (what a job scheduler sends before it ends a job, and what
  `timeout` sends) lets the rollout under way finish; a checkpoint is saved and the process
  exits 0, so the same command resumes from where it stopped rather than from the last
  periodic checkpoint. That it was received is said at once.
- During training Ctrl-C stops at once, in whatever phase: a person pressing it wants the
  prompt back now, and checkpoints are written to a temporary folder and renamed, so one
  cut short is never taken for complete. train.py says which checkpoint the same command
  resumes from. The exit code is 130 (128 + SIGINT), as a shell reports a Ctrl-C.

A second signal ends the process at once (exit 128 + signal), unless it comes within
ECHO_S of the first: torchrun passes the terminal's Ctrl-C (or a scheduler's SIGTERM) on
to workers that already got it from the terminal, and that echo must not cut the clean
stop short. Only rank 0 speaks; every rank stops.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from types import FrameType

import torch

from minisparse.utils.distributed import all_reduce

ECHO_S = 1.0  # a repeat of the signal this soon after the first is a launcher's echo
SIGNALS = (signal.SIGTERM, signal.SIGINT)
NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}


class Interrupted(BaseException):
    """Raised in the main thread by a signal that stops the run at once. A BaseException,
    like KeyboardInterrupt, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(NAMES.get(signum, str(signum)))
        self.signum = signum


class StopOnSignal:
    """Installs handlers for SIGTERM and SIGINT. `training()` marks the end of set-up;
    `requested()` is then true once any rank got a SIGTERM (every rank calls it at the
    same point of each rollout, so all stop after the same one)."""

    def __init__(self, term_notice: str = "", speak: bool = True) -> None:
        self.term_notice, self.speak = term_notice, speak
        self.received = False  # a SIGTERM during training: stop after the rollout
        self.first: float | None = None  # when the first signal came
        self.in_training = False
        self.interrupted: int | None = None  # the signal that raised Interrupted
        self.previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def training(self, term_notice: str | None = None) -> None:
        """Set-up is over: from here a SIGTERM waits for the rollout to end."""
        self.in_training = True
        if term_notice is not None:
            self.term_notice = term_notice

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.first is not None:
            if now - self.first < ECHO_S:
                return  # torchrun's copy of the signal the terminal already sent
            os._exit(128 + signum)  # a second one: at once, nothing more said
        self.first = now
        if signum == signal.SIGTERM and self.in_training:
            self.received = True
            self.say(self.term_notice)
            return
        self.interrupted = signum
        raise Interrupted(signum)

    def say(self, line: str) -> None:
        """One line on stdout from rank 0. Written to the file descriptor, unbuffered: the
        handler may run while the main thread is in the middle of a print, and a second
        write into the same buffered stream would raise."""
        if self.speak and line:
            os.write(sys.stdout.fileno(), (line + "\n").encode())

    def requested(self) -> bool:
        flag = torch.tensor([float(self.received)])
        return bool(all_reduce(flag, op="max").item() > 0)

    def close(self) -> None:
        """Give the signals back to the handlers that were there before."""
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)
