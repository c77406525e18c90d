"""trainer/stop.py: what a stop signal does where the run is (set-up, a droppable block, an
update, a collective), and the watchdog that ends a process whose main thread cannot stop."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from minisparse.trainer import stop
from minisparse.trainer.stop import Interrupted, StopOnSignal

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def signals():
    s = StopOnSignal(speak=True)
    yield s
    s.close()


def signalled(signum: int = signal.SIGTERM) -> None:
    """Send this process `signum`; Python runs its handler at the next bytecode."""
    os.kill(os.getpid(), signum)
    time.sleep(0.05)


def test_a_stop_in_set_up_ends_it_at_once(signals):
    with pytest.raises(Interrupted) as info:
        signalled(signal.SIGINT)
    assert info.value.signum == signal.SIGINT and signals.state == stop.STOPPING


def test_a_stop_drops_a_droppable_block_and_waits_for_an_update(signals, capfd):
    signals.training("{signal} received: after the update")
    with pytest.raises(Interrupted):
        with signals.droppable():
            signalled()
    assert capfd.readouterr().out == ""  # a dropped block: the final line says it all
    after = StopOnSignal()  # a new run: the update under way goes on, said once
    try:
        after.training("{signal} received: after the update")
        signalled()
        signalled()  # within ECHO_S: a launcher's echo, not a second signal
        assert after.pending and after.signum == signal.SIGTERM
        assert capfd.readouterr().out == "SIGTERM received: after the update\n"
        with pytest.raises(Interrupted):  # a droppable block after it ends at once
            with after.droppable():
                pass
    finally:
        after.close()


def test_a_stop_never_cuts_a_collective_in_two(signals):
    """Inside uncut() (a collective with its meet) the stop waits: it acts as the block
    ends, or earlier through leaving(), the meet's way out."""
    signals.training("")
    with pytest.raises(Interrupted):
        with signals.droppable():
            with signals.uncut():
                signalled()
                assert signals.pending and signals.leaving() is not None  # still here
            pytest.fail("the stop should act as the block ends")
    assert signals.state == stop.STOPPING and signals.leaving() is None


def test_past_the_commit_a_stop_waits_for_the_update(signals):
    signals.training("")
    with signals.droppable():
        signals.commit()  # single-process: no meet, the update is committed
    signalled()
    assert signals.state == stop.FINISH and signals.pending and signals.requested()


WATCHED = """
import os, select, signal, sys, time
sys.path.insert(0, {repo!r})
from minisparse.trainer import stop
stop.STOP_LIMIT_S = 1.0
signals = stop.StopOnSignal()
signals.stuck_line = lambda signum, why: f"stuck: {{why}}"
signals.training("")
with signals.droppable(), signals.uncut():  # as if blocked in a collective
    print("ready", flush=True)
    {body}
"""


def watched(body: str) -> subprocess.CompletedProcess:
    """A process whose main thread sits in an uncut block, sent SIGTERM(s) from here."""
    code = WATCHED.format(repo=str(REPO), body=textwrap.dedent(body))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    return proc


def test_a_second_signal_ends_the_process_though_its_main_thread_is_blocked():
    proc = watched("select.select([], [], [], 60)")
    time.sleep(stop.ECHO_S + 0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, stderr


def test_a_stop_that_cannot_finish_ends_the_process_with_a_line():
    """STOP_LIMIT_S after the signal (1 s here), outside an update or a save."""
    proc = watched("select.select([], [], [], 60)")
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert stdout == ("stuck: the operation under way (a collective, or one long computation) "
                      "did not return\n")
