"""Ctrl-C and the grading processes: a terminal sends SIGINT to the whole process group,
trainer and grading processes alike. The trainer owns the stop (one line, no traceback),
so a grading process must neither print a KeyboardInterrupt traceback nor die of it, and
the pool must still grade and then shut its workers down. Here a child process in a
session of its own holds a GradingPool; the test sends SIGINT to its whole group as the
child says it is waiting, or that the answer is in a worker's hands (a line, not a
guessed delay)."""
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Stands in for train.py: grading between steps, stopped by a Ctrl-C, then a report (the
# pause: what train.py does before it exits), and the pool's close at exit.
HOLDER = textwrap.dedent("""
    import os, sys, time
    from minisparse.data.grading_pool import GradingPool, _Worker

    pool = GradingPool()
    pool.run([("1/2", "0.5")], 5.0, 2, 60.0)
    while not all(w.ready for w in pool.workers):  # neither is still starting
        pool._wait(pool.workers, time.monotonic() + 1.0, {})
    print("ready", flush=True)
    send = _Worker.send

    def said(*args):
        send(*args)
        print("sent", flush=True)

    _Worker.send = said
    try:
        if sys.argv[1] == "grading":  # an answer in flight: sympy builds a huge integer
            pool.run([("(10^{9999})^{12345}", "1")], 30.0, 2, 60.0)
        else:
            print("waiting", flush=True)
            time.sleep(60)
        print("not interrupted", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    time.sleep(0.5)
    print("alive", all(w.proc.poll() is None for w in pool.workers), flush=True)
    print("graded", pool.run([("3/4", "0.75")], 5.0, 2, 60.0), flush=True)
    procs = [w.proc for w in pool.workers]
    pool.close()
    print("closed", all(p.returncode is not None for p in procs), flush=True)
""")


@pytest.mark.parametrize("phase", ["idle", "grading"])
def test_ctrl_c_to_the_process_group_leaves_the_workers_quiet(phase):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, phase], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert holder.stdout.readline() == "ready\n", holder.stderr.read()
        assert holder.stdout.readline() == {"idle": "waiting\n", "grading": "sent\n"}[phase]
        os.killpg(holder.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, err = holder.communicate(timeout=120)
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert out.splitlines() == ["interrupted", "alive True", "sent", "graded {0: True}",
                                "closed True"], (out, err)
    assert holder.returncode == 0, err


def test_a_worker_that_died_while_idle_is_replaced():
    """The request sent to a dead worker cannot be flushed; restarting it must not raise
    that again (it did: BrokenPipeError from closing its stdin crashed the batch)."""
    from minisparse.data.grading_pool import GradingPool

    pool = GradingPool()
    try:
        assert pool.run([("1/2", "0.5")], 5.0, 1, 60.0) == {0: True}
        dead = pool.workers[0].proc
        dead.kill()  # e.g. the OOM killer
        dead.wait()
        assert pool.run([("3/4", "0.75")], 5.0, 1, 60.0) == {0: True}
        assert dead.pid not in pool.pids()
    finally:
        pool.close()
