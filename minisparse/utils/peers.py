"""Whether the other processes of a torchrun job are alive, learned through the job's
rendezvous store (the TCPStore torchrun keeps at MASTER_ADDR:MASTER_PORT), never through
NCCL or gloo, and the waits between ranks.

A collective whose peer is dead or frozen waits out the process group's timeout (NCCL
spinning its GPU all the while), and a rank that finishes its share of a phase first
waits in the next collective for the slowest one: a short collective timeout would stop
healthy runs, a long one lets a dead run hold its GPUs for hours. Instead:

- Each rank's heartbeat thread bumps its counter in the store every `interval` seconds
  and reads everyone's. A peer whose counter has not moved for `timeout_s` (killed,
  frozen by kill -STOP, its node down or cut off), or that recorded why it left (an
  error, a stop), is lost: `on_lost` is called once, from the thread (train.py prints
  one line and ends the process: the main thread may be stuck in a collective).
- `meet()` is the wait before each collective (utils/distributed.py): every rank arrives
  through the store and waits there, without a limit, as long as everyone is alive; the
  collective then starts on all ranks together, so its timeout (dist.timeout_s) only
  has to cover the collective itself. A rank asked to stop while it waits takes its
  arrival back, so a meet never completes without a rank that left it.
- A stop signal one rank gets is posted for all (`post_stop`): every rank stops in the
  same rollout, whichever of them the scheduler or the user signalled.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

PREFIX = "minisparse/"  # the store also holds torchrun's and the process group's keys
FINISHED = "finished"  # what a rank records when it leaves at the end of a run
# A peer that left while this rank waits for it in a meet is lost, unless this rank
# leaves the meet within this long: a stop that dropped the rollout, with nothing to
# save, ends the ranks one after the other.
LEAVE_GRACE_S = 2.0


@dataclass(frozen=True)
class Loss:
    """A peer this rank will not hear from again: `rank` None for the store itself."""

    rank: int | None
    host: str
    why: str  # "went silent: no heartbeat for 121 s", "failed", ...

    def who(self) -> str:
        return f"rank {self.rank} ({self.host})" if self.rank is not None else self.host


class Peers:
    """This rank's heartbeat, its view of the others', and the meets between them."""

    def __init__(self, store, rank: int, world: int, timeout_s: float,
                 interval_s: float | None = None) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.interval = interval_s or min(5.0, max(0.2, timeout_s / 10))
        op_timeout = timedelta(seconds=max(10.0, 2 * self.interval))
        # one client per thread: a store client serves one request at a time
        self._main, self._beat, self._side = store.clone(), store.clone(), store.clone()
        for client in (self._main, self._beat, self._side):
            client.set_timeout(op_timeout)
        self._side_lock = threading.Lock()
        self._news_lock = threading.Lock()  # the heartbeat and the main thread both look
        self.others = [r for r in range(world) if r != rank]
        self.hosts = {r: f"rank {r}" for r in range(world)}
        self.on_lost: Callable[[Loss], None] = lambda loss: None
        self.on_stop: Callable[[int], None] = lambda signum: None
        self.lost: Loss | None = None
        self.threshold = timeout_s  # silence that makes a peer lost
        self.meets = 0  # meets completed (or under way): the same count on every rank
        self.epoch = ""  # "stop/" once this rank stops: the stop's meets are its own
        self.stop_seen = False
        self._gone_seen = 0
        self.departed: set[int] = set()  # peers that left at the end of their run
        self._counts: dict[int, bytes | None] = {r: None for r in self.others}
        self._heard = {r: time.monotonic() for r in self.others}  # last counter change
        self._quit = threading.Event()
        self._beat.set(f"{PREFIX}host/{rank}", socket.gethostname())
        self._beat.set(f"{PREFIX}beat/{rank}", "0")
        self._thread = threading.Thread(target=self._run, name="peer-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._quit.set()
        self._thread.join(timeout=2 * self.interval + 10)

    # ----------------------------------------------------------------- the heartbeat

    def _run(self) -> None:
        beats, last_tick, failing_since = 0, time.monotonic(), None
        while not self._quit.wait(self.interval) and self.lost is None:
            now = time.monotonic()
            if now - last_tick > 3 * self.interval + 5:  # this process itself was frozen
                self._heard = {r: now for r in self.others}
            last_tick = now
            try:
                beats += 1
                self._beat.set(f"{PREFIX}beat/{self.rank}", str(beats))
                loss = self._read(now)
                failing_since = None
            except Exception as exc:  # the store unreachable: its node gone or cut off
                failing_since = failing_since or now
                loss = None
                if now - failing_since >= self.timeout_s:
                    loss = Loss(None, "the rendezvous store", f"stopped answering ({exc})")
            if loss is not None:
                self._report(loss)

    def _report(self, loss: Loss) -> None:
        with self._news_lock:
            if self.lost is not None:
                return
            self.lost = loss
        self.on_lost(loss)

    def _stop_asked(self, client) -> None:
        """A stop request posted by any rank (this one's too) passed on, once."""
        with self._news_lock:
            if self.stop_seen or not client.check([f"{PREFIX}stop"]):
                return
            self.stop_seen = True
        self.on_stop(int(client.get(f"{PREFIX}stop")))

    def _read(self, now: float) -> Loss | None:
        """The others' counters, exits and stop requests; the first peer lost, if any."""
        for r in self.others:
            key = f"{PREFIX}beat/{r}"
            if self._counts[r] is None and not self._beat.check([key]):
                continue  # not started yet: silent from this rank's start on
            count = self._beat.get(key)
            if count != self._counts[r]:
                if self._counts[r] is None:
                    self.hosts[r] = self._beat.get(f"{PREFIX}host/{r}").decode()
                self._counts[r], self._heard[r] = count, now
        self._stop_asked(self._beat)
        if (loss := self._gone(self._beat, waiting=False)) is not None:
            return loss
        quiet, silent = self._quietest(now)
        if quiet is not None and silent >= self.threshold:
            return Loss(quiet, self.hosts[quiet],
                        f"went silent: no heartbeat for {silent:.0f} s (killed, frozen, or "
                        f"its node down or cut off)")
        return None

    def _gone(self, client, waiting: bool) -> Loss | None:
        """A peer that recorded why it left: an error, or, for a rank `waiting` for it in
        a meet (which it will never join), anything."""
        count = int(client.add(f"{PREFIX}gone", 0))
        with self._news_lock:
            if count == self._gone_seen and not waiting:
                return None
            self._gone_seen = count
        for r in self.others:
            key = f"{PREFIX}gone/{r}"
            if (r in self.departed and not waiting) or not client.check([key]):
                continue
            why = client.get(key).decode()
            if why != FINISHED:
                return Loss(r, self.hosts[r], why)
            self.departed.add(r)  # its heartbeat stops: not a silence
            if waiting:
                return Loss(r, self.hosts[r], "left the run while this rank waited for it")
        return None

    def suspect(self) -> None:
        """A collective failed (gloo's 'Connection closed by peer'): a few missed
        heartbeats are enough to tell which peer broke it."""
        self.threshold = min(self.timeout_s, 3 * self.interval + 1)

    def _quietest(self, now: float) -> tuple[int | None, float]:
        """The peer still in the run longest without a heartbeat, and for how long (s)."""
        staying = [r for r in self.others if r not in self.departed]
        if not staying:
            return None, 0.0
        r = max(staying, key=lambda r: now - self._heard[r])
        return r, now - self._heard[r]

    def silent_s(self) -> float:
        """The longest a peer has gone without a heartbeat, as this rank last looked."""
        return self._quietest(time.monotonic())[1]

    def quietest(self) -> str:
        """'rank 1 (host) has been silent for 16 s', of the peer longest without one."""
        r, silent = self._quietest(time.monotonic())
        return f"rank {r} ({self.hosts[r]}) has been silent for {silent:.0f} s"

    # ------------------------------------------------------------- what ranks post

    def leave(self, why: str) -> None:
        """Record why this rank leaves (FINISHED, or what stopped it) for the others."""
        with self._side_lock:
            self._side.set(f"{PREFIX}gone/{self.rank}", why)
            self._side.add(f"{PREFIX}gone", 1)

    def post_stop(self, signum: int) -> None:
        """Ask every rank to stop (the first request stands); from any thread."""
        with self._side_lock:
            self._side.compare_set(f"{PREFIX}stop", "", str(signum))

    # ------------------------------------------------------------------------ meets

    def meet(self, leaving: Callable[[], BaseException | None]) -> None:
        """Wait, in the store, until every rank has arrived here (the main thread, before
        each collective). While waiting, `leaving()` may give an exception: this rank's
        arrival is then taken back, unless the last rank came meanwhile, and it is raised.
        The heartbeat thread ends the process meanwhile if a peer is lost."""
        key = f"{PREFIX}meet/{self.epoch}{self.meets}"
        self.meets += 1
        count, delay, looked = int(self._main.add(key, 1)), 0.0005, time.monotonic()
        left_at = None  # when a peer was first seen gone: a stop may take this rank too
        while count < self.world:
            look = time.monotonic() - looked > 0.1  # a stop or an exit, before the heartbeat
            if look:
                looked = time.monotonic()
                self._stop_asked(self._main)
            exc = leaving()
            if look and exc is None and self.lost is None:
                if (loss := self._gone(self._main, waiting=True)) is None:
                    left_at = None
                elif left_at is None:
                    left_at = looked
                elif looked - left_at > LEAVE_GRACE_S:
                    self._report(loss)
            if exc is not None:
                # take the arrival back, atomically: only while the others are still short
                now = int(self._main.compare_set(key, str(count), str(count - 1)))
                if now == count - 1:
                    self.meets -= 1
                    raise exc
                count = now  # someone came or went meanwhile: look again
                continue
            time.sleep(delay)
            delay = min(2 * delay, 0.02)
            count = int(self._main.add(key, 0))
        if self.rank == 0 and self.meets > 1:  # everyone has left the one before
            self._main.delete_key(f"{PREFIX}meet/{self.epoch}{self.meets - 2}")

    def stopping(self) -> None:
        """This rank stops: its meets from here (a save) are counted apart, so that none
        is taken for the meet where a rank that has not heard of the stop yet waits (it
        leaves that one when it hears)."""
        if not self.epoch:
            self.epoch, self.meets = "stop/", 0
