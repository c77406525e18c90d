"""Stopping between rollouts on SIGTERM: what a job scheduler sends before it ends a job,
and what `timeout` sends when a time limit runs out. The rollout under way is finished,
a checkpoint is saved and the process exits 0, so the same command resumes from where it
stopped rather than from the last periodic checkpoint (the rollouts in between would be
lost and redone). A second SIGTERM ends the process at once, as usual.
"""
from __future__ import annotations

import signal
from types import FrameType

import torch

from minisparse.trainer.distributed import all_reduce


class StopOnSignal:
    """Installs the handler; `requested()` is true once any rank got the signal (every
    rank calls it at the same point of each rollout, so all stop after the same one)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum
        self.received = False
        self.previous = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        signal.signal(signum, signal.SIG_DFL)  # a second one ends the process

    def requested(self) -> bool:
        flag = torch.tensor([float(self.received)])
        return bool(all_reduce(flag, op="max").item() > 0)

    def close(self) -> None:
        """Give the signal back to the handler that was there before."""
        signal.signal(self.signum, self.previous)
