"""One run per output folder (trainer/run_lock.py): a second run is refused naming the
holder, a killed run's record is taken over saying so, a clean exit leaves no record.
tests/train/test_train.py runs two train.py processes in one folder."""
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from minisparse.trainer.run_lock import (LOCK_FILE, Holder, RunLock, RunLockError,
                                         _process_start, hold_output_dir)

REPO = Path(__file__).resolve().parents[2]


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _plant(out: Path, holder: Holder) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK_FILE).write_text(json.dumps(asdict(holder)))


def _when(holder: Holder) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.started))


def test_a_second_lock_on_the_folder_is_refused_naming_the_holder(tmp_path):
    out = str(tmp_path / "out")
    first = hold_output_dir(out)  # makes the folder
    assert first is not None
    me = Holder(**json.loads((tmp_path / "out" / LOCK_FILE).read_text()))
    assert (me.pid, me.host) == (os.getpid(), socket.gethostname())
    with pytest.raises(RunLockError) as info:
        RunLock(out).acquire()
    assert str(info.value) == (f"{out} is in use by another run (pid {os.getpid()} on host "
                               f"{socket.gethostname()}, started {_when(me)}); wait for it "
                               f"or choose another output_dir")
    first.release()
    first.release()  # idempotent (and run again at exit)
    assert (tmp_path / "out" / LOCK_FILE).read_text() == ""  # a clean release: no record
    again = RunLock(out)
    assert again.acquire() is None  # nothing to take over
    again.release()


def test_a_dead_runs_record_is_taken_over_with_a_line(tmp_path):
    out = tmp_path / "out"
    dead = replace(Holder.me(), pid=_dead_pid(), process_start=None)
    _plant(out, dead)
    lock = RunLock(str(out))
    assert lock.acquire() == (f"{out}: taking it over from a run that ended without "
                              f"releasing it (pid {dead.pid} on host {dead.host}, started "
                              f"{_when(dead)})")
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_reused_pid_is_not_its_run_but_a_live_unlocked_holder_is(tmp_path):
    """Where flock did not stop it (a file system without it), a record naming a live
    process on this host still refuses; the same pid started at another time (reused by
    a later process) does not."""
    sleeper = subprocess.Popen(["sleep", "3600"])  # alive for the test, killed after
    try:
        live = replace(Holder.me(), pid=sleeper.pid, process_start=_process_start(sleeper.pid))
        _plant(tmp_path / "live", live)
        with pytest.raises(RunLockError, match=f"in use by another run \\(pid {sleeper.pid} "):
            RunLock(str(tmp_path / "live")).acquire()
        if live.process_start is None:
            pytest.skip("no /proc: a reused pid cannot be told apart")
        _plant(tmp_path / "reused", replace(live, process_start="another-boot/1"))
        lock = RunLock(str(tmp_path / "reused"))
        assert "taking it over" in lock.acquire()
        lock.release()
    finally:
        sleeper.kill()
        sleeper.wait()


TAKE = ("import signal, sys; from minisparse.trainer.run_lock import RunLock; "
        "RunLock(sys.argv[1]).acquire(); print('held', flush=True); ")


@pytest.mark.parametrize("end,record_left", [
    ("raise SystemExit(3)", False),
    ("raise KeyboardInterrupt", False),  # Ctrl-C
    ("signal.raise_signal(signal.SIGKILL)", True),
])
def test_the_lock_goes_with_the_process_and_a_clean_exit_clears_the_record(
        tmp_path, end, record_left):
    out = tmp_path / "out"
    out.mkdir()
    res = subprocess.run([sys.executable, "-c", TAKE + end, str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.stdout == "held\n", res.stderr[-2000:]
    assert ((out / LOCK_FILE).read_text() != "") == record_left
    lock = RunLock(str(out))  # free again either way
    assert (lock.acquire() is not None) == record_left
    lock.release()
