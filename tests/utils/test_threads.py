"""torch's CPU thread count: cpu_threads, else OMP_NUM_THREADS, else one per physical core
less the cores other work keeps busy, never below one; and the start line that says it."""
import os

import pytest
import torch

from minisparse.utils import threads
from minisparse.utils.threads import ThreadChoice, busy_cores, choose_threads, set_threads


@pytest.mark.parametrize("setting, env, cores, busy, want, why", [
    (0, None, 2, 0.0, 2, "2 physical cores"),
    (0, None, 2, 0.3, 2, "2 physical cores"),  # noise is not a busy core
    (0, None, 2, 1.0, 1, "2 physical cores, 1.0 busy with other work"),  # the case
    (0, None, 2, 3.7, 1, "2 physical cores, 3.7 busy with other work"),  # never below 1
    (0, None, 8, 2.6, 5, "8 physical cores, 2.6 busy with other work"),
    (0, None, 1, 0.0, 1, "1 physical core"),
    (0, "3", 2, 1.0, 3, "OMP_NUM_THREADS"),  # the user's choice is kept
    (0, "0", 2, 1.0, 1, "2 physical cores, 1.0 busy with other work"),  # 0 is no choice
    (0, "many", 2, 0.0, 2, "2 physical cores"),
    (4, "3", 2, 1.0, 4, "cpu_threads"),  # the key wins
])
def test_the_thread_count_and_why(setting, env, cores, busy, want, why):
    assert choose_threads(setting, env, cores, busy) == ThreadChoice(want, why)


def test_the_start_line_says_how_to_change_it():
    assert ThreadChoice(1, "2 physical cores, 1.0 busy with other work").line() == (
        "threads: 1 (2 physical cores, 1.0 busy with other work); change with --set "
        "cpu_threads=N or OMP_NUM_THREADS=N")


def test_set_threads_applies_the_choice(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        assert set_threads(1) == ThreadChoice(1, "cpu_threads")
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert set_threads(0) == ThreadChoice(2, "OMP_NUM_THREADS")
        assert torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(threads, "busy_cores", lambda cpus: 0.0)
        monkeypatch.setattr(threads, "physical_cores", lambda cpus: 3)
        assert set_threads(0) == ThreadChoice(3, "3 physical cores")
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_physical_cores_count_a_core_once_and_keep_to_a_quota(monkeypatch):
    cpus = threads.allowed_cpus()
    assert cpus and set(cpus) <= set(range(os.cpu_count()))
    assert 1 <= threads.physical_cores(cpus) <= len(cpus)
    monkeypatch.setattr(threads, "cgroup_cpus", lambda: 0.5)  # docker --cpus 0.5
    assert threads.physical_cores(cpus) == 1


def test_busy_cores_leave_this_process_out(monkeypatch):
    """Two CPUs busy 150 of 200 ticks over the sample are 1.5 cores' worth; this process
    used half a core of it (os.times: 0.5 s in 1 s), so other work keeps 1.0 busy."""
    ticks = iter([(1000, 4000), (1150, 4200)])  # (busy, total) before and after
    clock = iter([(10.0, 1.0, 0.0, 0.0, 0.0), (10.4, 1.1, 0.0, 0.0, 0.0)])
    monkeypatch.setattr(threads, "_cpu_times", lambda cpus: next(ticks))
    monkeypatch.setattr(threads.os, "times", lambda: next(clock))
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    assert busy_cores([0, 1], 1.0) == pytest.approx(1.0)


def test_busy_cores_read_from_this_machine():
    cpus = threads.allowed_cpus()
    busy, total = threads._cpu_times(cpus)
    assert 0 <= busy <= total and total > 0
    assert 0.0 <= busy_cores(cpus, 0.05) <= len(cpus)
