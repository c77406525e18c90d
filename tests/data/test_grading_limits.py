"""Grading's hard limits (reward.timeout_s): a pathological answer stops at its limit in a
thread as on the main thread, its copies cost one timeout, a batch of them has a budget,
and a grading process that ignores its alarm is killed. The pathological answer is
(10^{9999})^{K}: it passes the string filter, and sympy builds a 10^8-digit integer in C
(minutes where no signal reaches it). What is sent to the grading processes is counted;
timings assert only lower bounds and generous upper ones (a busy machine is slow, the
code before the limits took minutes)."""
import itertools
import math
import multiprocessing
import os
import signal
import threading
import time

import pytest

import minisparse.data.grading_pool as grading_pool
import minisparse.data.reward as reward
from minisparse.config.load import load_config
from minisparse.config.schema import ConfigError, RewardConfig
from minisparse.data.grading_pool import KILL_GRACE_S
from minisparse.data.reward import Grade, grade, grade_batch

LIMIT = 0.5
SLACK = 30.0  # scheduling on a loaded machine; the code before the limits took minutes
_fresh = itertools.count(9000)  # the outcome cache lives as long as the process


def pathological() -> str:
    """A response whose answer nobody has graded yet in this process."""
    return f"So the result is \\boxed{{(10^{{9999}})^{{{next(_fresh)}}}}}."


@pytest.fixture(autouse=True)
def _started():
    """Both grading processes ready before anything is timed or counted (a start is ~1 s,
    once a run; a batch waits only for the first, so on a busy machine the second could
    join a test's batch late)."""
    grade_batch(["\\boxed{\\frac{1}{2}}"], ["0.5"], workers=2)
    pool, deadline = reward._grading_pool(), time.monotonic() + 300
    while not all(w.ready for w in pool.workers):
        assert time.monotonic() < deadline, "a grading process did not start in 300 s"
        pool._wait(pool.workers, time.monotonic() + 1.0, {})


@pytest.fixture
def sent(monkeypatch) -> list[tuple[str, int]]:
    """(answer, answers in flight just after) for each answer sent to a grading process."""
    seen = []
    send = grading_pool._Worker.send

    def spy(worker, item, answer, label, timeout_s):
        send(worker, item, answer, label, timeout_s)
        busy = sum(w.item is not None for w in reward._grading_pool().workers)
        seen.append((answer, busy))

    monkeypatch.setattr(grading_pool._Worker, "send", spy)
    return seen


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def test_a_thread_gets_its_answer_at_the_limit():
    out = []
    response = pathological()
    worker = threading.Thread(target=lambda: out.append(grade(response, "1", LIMIT)))
    _, seconds = _timed(lambda: (worker.start(), worker.join(60)))
    assert not worker.is_alive() and out[0].timed_out and out[0].score == 0.0
    assert seconds < LIMIT + SLACK


def test_the_main_thread_gets_its_answer_at_the_limit():
    grades, seconds = _timed(lambda: grade_batch([pathological(), pathological()], ["1", "1"],
                                                 timeout_s=LIMIT)[0])
    assert all(g.timed_out for g in grades)
    assert seconds < 2 * LIMIT + SLACK


def test_copies_of_a_pathological_answer_cost_one_timeout(sent):
    response = pathological()
    grades, stats = grade_batch([response] * 32, ["1"] * 32, timeout_s=LIMIT)
    assert stats["timeouts"] == 32 and stats["over_budget"] == 0
    assert [a for a, _ in sent] == [grades[0].answer]  # graded once (before: 32 times)
    _, stats = grade_batch([response] * 32, ["1"] * 32, timeout_s=LIMIT)
    assert stats["timeouts"] == 32 and len(sent) == 1  # remembered across batches
    pair = (grades[0].answer, "1")
    assert reward._outcomes.get(pair, LIMIT) == grades[0]
    assert reward._outcomes.get(pair, 2 * LIMIT) is None  # a longer limit tries again


def test_distinct_pathological_answers_take_a_limit_per_worker_round(sent):
    distinct, workers = 4, 2
    bad = [pathological() for _ in range(distinct)]
    good = ["\\boxed{\\dfrac{3}{4}}", "\\boxed{(1, 2]}", "\\boxed{7}"]
    responses = bad * 8 + good
    labels = ["1"] * (8 * distinct) + ["0.75", "(1,2]", "8"]
    (grades, stats), seconds = _timed(
        lambda: grade_batch(responses, labels, timeout_s=LIMIT, workers=workers))
    assert stats["timeouts"] == 8 * distinct and stats["over_budget"] == 0
    assert [g.score for g in grades[-3:]] == [1.0, 1.0, 0.0]  # the rest grade as ever
    answers = [a for a, _ in sent]
    assert sorted(set(answers)) == sorted(answers)  # each distinct answer sent once
    assert {g.answer for g in grades[:distinct]} <= set(answers)
    assert max(busy for _, busy in sent) == workers  # side by side
    rounds = math.ceil(distinct / workers)
    assert seconds < (LIMIT + KILL_GRACE_S) * rounds + SLACK


def test_a_batch_stops_grading_at_its_budget():
    n = 12
    budget = reward.batch_budget_s(n, LIMIT, 1)
    (grades, stats), seconds = _timed(
        lambda: grade_batch([pathological() for _ in range(n)], ["1"] * n, timeout_s=LIMIT))
    sent = math.ceil(budget / LIMIT) + 1  # at most this many started before it ran out
    assert stats["timeouts"] == n and stats["over_budget"] >= n - sent
    assert all(g.score == 0.0 for g in grades)
    # the answers in flight when the budget runs out still get their limit
    assert seconds < budget + LIMIT + KILL_GRACE_S + SLACK
    skipped = next(g for g in grades if g.over_budget)
    assert reward._outcomes.get((skipped.answer, "1"), LIMIT) is None  # graded next time


def test_a_worker_that_ignores_its_alarm_is_killed_and_replaced():
    pool = reward._grading_pool()
    stuck = pool.workers[0].proc.pid
    os.kill(stuck, signal.SIGSTOP)  # like C code that never looks at signals
    got, seconds = _timed(lambda: grade("\\boxed{\\frac{5}{8}}", "0.625", LIMIT))
    assert got == Grade(0.0, "\\frac{5}{8}", timed_out=True)
    assert LIMIT + KILL_GRACE_S <= seconds < LIMIT + KILL_GRACE_S + SLACK
    assert stuck not in pool.pids()
    assert grade("\\boxed{\\frac{5}{9}}", "5/9", LIMIT).score == 1.0  # its replacement


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_child_process_grades_with_workers_of_its_own(method):
    with multiprocessing.get_context(method).Pool(1) as child:
        right = child.apply(grade, ("\\boxed{\\frac{7}{8}}", "0.875", LIMIT))
        slow, seconds = _timed(lambda: child.apply(grade, (pathological(), "1", LIMIT)))
    assert right.score == 1.0 and slow.timed_out
    assert seconds < LIMIT + SLACK + 3  # the child's first grading process starts here


@pytest.mark.parametrize("value", ["0", "-1", "0.0"])
def test_the_limit_must_be_positive(value):
    with pytest.raises(ConfigError) as info:
        load_config("tiny_rkv", [f"reward.timeout_s={value}"])
    message = str(info.value)
    assert f"'reward.timeout_s' must be > 0, got {float(value)}" in message
    assert "\n" not in message


def test_the_limit_is_a_setting():
    assert RewardConfig().timeout_s == reward.DEFAULT_TIMEOUT_S == 2.0
    assert load_config("tiny_rkv", ["reward.timeout_s=0.5"]).reward.timeout_s == 0.5


def test_grading_workers_follow_the_setting_or_the_cores():
    """reward.workers > 0 is taken as is; 0 takes one process per two physical cores of
    this process's share of the host (torchrun's LOCAL_WORLD_SIZE processes), 1 to 8."""
    from minisparse.data.reward import grading_workers

    assert grading_workers(3, cores=64, local_processes=1) == 3
    assert grading_workers(0, cores=2, local_processes=1) == 1  # the 2-core quick start
    assert grading_workers(0, cores=16, local_processes=1) == 8
    assert grading_workers(0, cores=16, local_processes=4) == 2
    assert grading_workers(0, cores=64, local_processes=2) == 8
    assert grading_workers(0, cores=1, local_processes=8) == 1
