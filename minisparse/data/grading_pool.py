"""Grading processes that are killed past the per-answer limit (data/reward.py's grade_batch
sends them every answer that needs math-verify).

Why processes: sympy's big-integer arithmetic runs in C. SIGALRM interrupts it only in a
process's main thread (CPython's integer loops check signals there), and nothing can
interrupt it in any other thread: graded from a thread, one answer ran 303 s. A worker
grades each answer in its own main thread under SIGALRM at the limit, which stops
pathological answers in place; the parent kills a worker that has not answered
KILL_GRACE_S later (C code that never checks signals, a hang) and starts another.

Why subprocess, not multiprocessing: nothing of the trainer is forked (it may hold CUDA
and NCCL state), the worker does not re-import the parent's __main__ (train.py and torch,
as the spawn method does), and whichever start method the parent set does not matter.
Workers speak JSON lines: "ready" once math-verify is imported, then one reply per
[answer, label, timeout_s] request: true, false, or null when the alarm stopped it.
"""
from __future__ import annotations

import json
import math
import os
import select
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

KILL_GRACE_S = 0.5  # past the limit before a worker that has not answered is killed
START_TIMEOUT_S = 120.0  # a worker that cannot import math-verify in this long is broken
_ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds minisparse/


class _Worker:
    """One grading process with at most one answer in flight."""

    def __init__(self) -> None:
        self._launch()

    def _launch(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)}
        # Linux ties a child's death signal to the thread that started it: asked for only
        # from the main thread, whose end is the process's.
        in_main = threading.current_thread() is threading.main_thread()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minisparse.data.grading_worker", str(os.getpid() * in_main)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.fd = self.proc.stdout.fileno()
        self.pending = b""
        self.ready = False
        self.item: int | None = None  # index of the answer in flight
        self.deadline = math.inf  # when it is killed if it has not answered

    def send(self, item: int, answer: str, label: str, timeout_s: float) -> None:
        request = json.dumps([answer, label, timeout_s]).encode() + b"\n"
        self.proc.stdin.write(request)
        self.proc.stdin.flush()
        self.item, self.deadline = item, time.monotonic() + timeout_s + KILL_GRACE_S

    def replies(self) -> list | None:
        """The replies that have arrived (call when its pipe is readable); None: it died."""
        data = os.read(self.fd, 65536)
        if not data:
            return None
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()
        return [json.loads(line) for line in lines]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        try:
            self.proc.stdin.close()
        except BrokenPipeError:  # a request that a worker dead while idle never read: its
            pass  # flush fails again here, but close() closes the pipe all the same
        self.proc.stdout.close()

    def restart(self) -> None:
        self.kill()
        self._launch()


class GradingPool:
    """Worker processes kept for the life of the process; grows to the largest number any
    batch asked for (a smaller batch uses the first ones)."""

    def __init__(self) -> None:
        self.owner = os.getpid()  # a forked copy of this object must not use the workers
        self.workers: list[_Worker] = []

    def run(self, pairs: list[tuple[str, str]], timeout_s: float, workers: int,
            budget_s: float) -> dict[int, bool | None]:
        """math-verify's verdict for each (answer, label) by index, None where it ran past
        timeout_s. Answers not yet sent when budget_s has passed are left out (the
        caller scores them 0); those in flight then still get their limit."""
        self._start(workers)
        active = self.workers[:workers]
        try:
            return self._grade(pairs, timeout_s, active, time.monotonic() + budget_s)
        except BaseException:  # e.g. KeyboardInterrupt: a late reply must not land in
            for w in active:  # the next batch
                if w.item is not None:
                    w.restart()
            raise

    def _grade(self, pairs: list[tuple[str, str]], timeout_s: float, active: list[_Worker],
               stop: float) -> dict[int, bool | None]:
        todo, verdicts = deque(range(len(pairs))), {}
        while True:
            for w in active:
                if w.ready and w.item is None and todo and time.monotonic() < stop:
                    self._send(w, todo, pairs, timeout_s)
            busy = [w for w in active if w.item is not None]
            if not busy and (not todo or time.monotonic() >= stop):
                return verdicts
            wake = min([w.deadline for w in busy] + [stop if todo else math.inf])
            self._wait(active, wake, verdicts)
            for w in busy:
                if w.item is not None and time.monotonic() >= w.deadline:
                    verdicts[w.item] = None  # ran past the limit in C: killed
                    w.restart()

    @staticmethod
    def _send(worker: _Worker, todo: deque, pairs: list[tuple[str, str]],
              timeout_s: float) -> None:
        """The next answer to an idle worker; one that died while idle is restarted and
        the answer waits for the next."""
        try:
            worker.send(todo[0], *pairs[todo[0]], timeout_s)
            todo.popleft()
        except BrokenPipeError:
            worker.restart()

    def launch(self, workers: int) -> None:
        """Start the missing workers without waiting for them to import math-verify. Called
        from the main thread, it gives them the death signal that a worker launched from
        another thread cannot have (_Worker._launch)."""
        self.workers += [_Worker() for _ in range(workers - len(self.workers))]

    def _start(self, workers: int) -> None:
        """Start missing workers; wait (not counted in any batch budget) until at least
        one can take answers."""
        self.launch(workers)
        give_up = time.monotonic() + START_TIMEOUT_S
        while not any(w.ready for w in self.workers[:workers]):
            if time.monotonic() > give_up:
                raise RuntimeError(f"no grading process started in {START_TIMEOUT_S:.0f} s")
            self._wait(self.workers[:workers], give_up, {})

    def _wait(self, active: list[_Worker], until: float, verdicts: dict) -> None:
        """Read what the workers say until one speaks or `until` passes (poll, not select:
        a trainer's descriptors may number over 1024)."""
        poller = select.poll()
        for w in active:
            poller.register(w.fd, select.POLLIN)
        wait_s = max(0.0, min(until - time.monotonic(), 60.0))  # until may be inf
        readable = {fd for fd, _ in poller.poll(math.ceil(1000 * wait_s))}
        for w in [w for w in active if w.fd in readable]:
            replies = w.replies()
            if replies is None:
                self._died(w, verdicts)
                continue
            for reply in replies:
                if reply == "ready":
                    w.ready = True
                else:
                    verdicts[w.item], w.item, w.deadline = reply, None, math.inf

    def _died(self, worker: _Worker, verdicts: dict) -> None:
        """A worker exited on its own: a crash while grading scores that answer 0; one
        that never started means the environment cannot grade at all."""
        if not worker.ready:
            raise RuntimeError(f"a grading process exited while starting (code "
                               f"{worker.proc.wait()}); run `python -m "
                               f"minisparse.data.grading_worker` to see why")
        if worker.item is not None:
            verdicts[worker.item] = False
        worker.restart()

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def close(self) -> None:
        """Kill the workers (at exit); a forked copy of the pool leaves its parent's be."""
        if os.getpid() != self.owner:
            return
        for w in self.workers:
            w.kill()
        self.workers = []
