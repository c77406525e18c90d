"""The rollout's hand-over: score_batch grades with the processes and limit the config
asks for and shapes the rewards, BackgroundGrading does the same beside its caller; the
engine's generate calls as perf/* metrics."""
import threading

import pytest
import torch

import minisparse.data.reward as reward

from minisparse.config.schema import RewardConfig
from minisparse.engine.sequence import GenerateStats
from minisparse.grpo.batch import RolloutBatch, rollout_metrics
from minisparse.rollout import BackgroundGrading, generate_metrics, grade_responses, score_batch


class CharTokenizer:
    """Token ids are character codes."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(map(chr, row)) for row in ids]


def test_score_batch_grades_with_the_workers_and_limit_given(grade_calls):
    texts = ["\\boxed{2}", "\\boxed{3}", "no answer"]
    batch = RolloutBatch(
        prompts=[[1]] * 3, responses=[list(map(ord, t)) for t in texts], labels=["2"] * 3,
        finish_reasons=["stop"] * 3, rollout_logp=torch.zeros(3, 9),
        response_mask=torch.ones(3, 9, dtype=torch.bool), num_compressions=[0] * 3,
        evicted_tokens=[0] * 3, peak_cache_tokens=[0] * 3, compressed_tokens=[0] * 3)
    stats = score_batch(batch, CharTokenizer(), RewardConfig(workers=4, timeout_s=0.7))
    assert grade_calls == [(4, 0.7)]
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0]
    assert stats["accuracy"] == 1 / 3 and stats["no_answer"] == 1


def _graded_batch(texts: list[str], finish_reasons: list[str]) -> RolloutBatch:
    n = len(texts)
    width = max(len(t) for t in texts)
    return RolloutBatch(
        prompts=[[1]] * n, responses=[list(map(ord, t)) for t in texts], labels=["2"] * n,
        finish_reasons=finish_reasons, rollout_logp=torch.zeros(n, width),
        response_mask=torch.ones(n, width, dtype=torch.bool), num_compressions=[0] * n,
        evicted_tokens=[0] * n, peak_cache_tokens=[0] * n, compressed_tokens=[0] * n)


def test_overlong_penalty_shapes_rewards_but_not_accuracy():
    """Three right answers of 9, 15 and 20 characters (20: cut off) and a wrong one of 20,
    max_response_len 20, buffer 10: rewards lose 0, 0.5 and 1.0; the wrong answer goes to
    -1. rollout/accuracy counts the grader's 3 of 4, not the shaped rewards' 1 of 4."""
    texts = ["\\boxed{2}", "\\boxed{2} and s", "\\boxed{2} and so on,", "\\boxed{3} and so on,"]
    batch = _graded_batch(texts, ["stop", "stop", "length", "length"])
    stats = score_batch(batch, CharTokenizer(), RewardConfig(overlong_buffer=10),
                        max_response_len=20)
    assert [len(t) for t in texts] == [9, 15, 20, 20]
    assert batch.scores.tolist() == [1.0, 1.0, 1.0, 0.0]
    assert batch.rewards.tolist() == pytest.approx([1.0, 0.5, 0.0, -1.0])
    assert stats["overlong_penalty_mean"] == pytest.approx(2.5 / 4)
    assert stats["overlong_penalized_frac"] == pytest.approx(3 / 4)
    metrics = rollout_metrics(batch)
    assert metrics["rollout/accuracy"] == pytest.approx(0.75)
    assert metrics["rollout/reward_mean"] == pytest.approx(0.5 / 4)
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(2.5 / 4)


def test_without_a_buffer_rewards_are_the_grades():
    batch = _graded_batch(["\\boxed{2} and so on,"], ["length"])
    stats = score_batch(batch, CharTokenizer(), RewardConfig(), max_response_len=20)
    assert batch.rewards.tolist() == [1.0] and "overlong_penalty_mean" not in stats
    with pytest.raises(ValueError, match="max_response_len"):
        score_batch(batch, CharTokenizer(), RewardConfig(overlong_buffer=4))


def test_background_grading_runs_beside_its_caller(monkeypatch):
    """The grader starts on the thread's own time: it is under way (and waits) while the
    caller goes on, and result() hands back what grade_responses gives, the grading
    processes launched before the thread starts (from the caller's thread, so they die
    with the trainer)."""
    started, release, real = threading.Event(), threading.Event(), reward.grade_batch
    launched = []

    def held(responses, labels, **kwargs):
        launched.append(len(reward._grading_pool().workers))
        started.set()
        assert release.wait(30)
        return real(responses, labels, **kwargs)

    monkeypatch.setattr(reward, "grade_batch", held)
    monkeypatch.setattr(reward, "_pool", None)  # a pool of its own, no workers yet
    batch = _graded_batch(["\\boxed{2}", "\\boxed{3}", "no answer"], ["stop"] * 3)
    grading = BackgroundGrading(batch, CharTokenizer(), RewardConfig(workers=2))
    assert started.wait(30)  # grading under way while this thread runs
    assert launched == [2]
    release.set()
    scores, stats = grading.result()
    monkeypatch.setattr(reward, "grade_batch", real)
    want_scores, want_stats = grade_responses(batch, CharTokenizer(), RewardConfig(workers=2))
    assert scores == want_scores == [1.0, 0.0, 0.0]
    assert {k: v for k, v in stats.items() if k != "grade_s"} == \
        {k: v for k, v in want_stats.items() if k != "grade_s"}
    assert batch.rewards is None  # the thread changed nothing of the batch


def test_background_grading_raises_what_the_grader_raised(monkeypatch):
    def broken(responses, labels, **kwargs):
        raise OSError("no grading process")

    monkeypatch.setattr(reward, "grade_batch", broken)
    grading = BackgroundGrading(_graded_batch(["\\boxed{2}"], ["stop"]), CharTokenizer(),
                                RewardConfig(workers=1))
    with pytest.raises(OSError, match="no grading process"):
        grading.result()


def test_generate_metrics_sum_the_calls_of_a_rollout():
    """Two generate calls (dynamic sampling): tokens, preemptions and phase times summed,
    throughput over the summed wall time, peaks the larger one's."""
    calls = [GenerateStats(generated_tokens=300, wall_s=2.0, peak_kv_tokens=900,
                           peak_pages_used=60, preemptions=1, prefill_s=0.25, decode_s=1.0,
                           compress_s=0.5, compress_events=3, prefill_tokens=120,
                           shared_prompt_tokens=80, steps=50, decode_steps=47),
             GenerateStats(generated_tokens=100, wall_s=2.0, peak_kv_tokens=400,
                           peak_pages_used=70, prefill_s=0.25, decode_s=0.5, compress_s=0.25,
                           prefill_tokens=40, steps=20, decode_steps=19)]
    assert generate_metrics(calls) == {
        "perf/rollout_tokens_per_s": 100.0, "perf/rollout_tokens": 400.0,
        "perf/peak_kv_tokens": 900.0, "perf/peak_kv_pages": 70.0, "perf/preemptions": 1.0,
        "perf/rollout_prefill_s": 0.5, "perf/prefill_steps": 4.0, "perf/prefill_tokens": 160.0,
        "perf/shared_prompt_tokens": 80.0, "perf/rollout_decode_s": 1.5,
        "perf/rollout_compress_s": 0.75, "perf/compress_events": 3.0,
        "perf/decode_graph_share": 0.0,
        "perf/fused_kernels": 0.0}
