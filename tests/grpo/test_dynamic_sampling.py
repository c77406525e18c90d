"""Dynamic sampling: rounds of prompts until the batch holds only groups with signal,
on one rank and on two gloo ranks through the collective passed in as `reduce` (same
number of rounds and samples on both)."""
import pickle

import pytest
import torch
from spawned_ranks import spawned_rank

from minisparse.config.load import load_config
from minisparse.config.schema import ConfigError
from minisparse.grpo import alone
from minisparse.grpo.dynamic_sampling import sample_with_signal, signal_groups
from minisparse.grpo.batch import RolloutBatch

GROUP = 2


def _batch(rewards: list[float], tag: str) -> RolloutBatch:
    """Groups of GROUP samples; response k of the batch has k + 1 tokens, named by tag."""
    n = len(rewards)
    mask = torch.tensor([[t <= k for t in range(n)] for k in range(n)])
    return RolloutBatch(
        prompts=[[1]] * n, responses=[[ord(c) for c in f"{tag}{k}"][:1] * (k + 1)
                                      for k in range(n)],
        labels=[f"{tag}{k}" for k in range(n)], finish_reasons=["stop"] * n,
        rollout_logp=-mask.float() * (torch.arange(n)[:, None] + 1), response_mask=mask,
        num_compressions=[0] * n, evicted_tokens=[0] * n, peak_cache_tokens=[0] * n,
        compressed_tokens=[0] * n,
        metadata=[{"k": k} for k in range(n)], grade_stats=None)


def _run(rounds: list[list[float]], needed: int, max_rounds: int, reduce=alone):
    """sample_with_signal over preset rewards per round; the rounds it drew."""
    drawn = []

    def draw(r):
        drawn.append(r)
        return _batch(rounds[r], "abcdefgh"[r])

    def score(batch):
        batch.rewards = torch.tensor(rounds[drawn[-1]])
        batch.grade_stats = {"accuracy": batch.rewards.mean().item(), "timeouts": 1.0,
                             "overlong_penalty_mean": 0.5 if drawn[-1] == 0 else 0.1}

    out, metrics = sample_with_signal(draw, score, GROUP, needed, max_rounds, reduce=reduce)
    return out, metrics, drawn


def test_signal_groups():
    assert signal_groups(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), 2).tolist() == [
        True, False, False]


def test_rounds_until_the_batch_has_signal():
    # round a: groups (1,0) signal, (1,1) none; round b: (0,0) none, (0,1) signal
    out, m, drawn = _run([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]], needed=2, max_rounds=4)
    assert drawn == [0, 1]
    assert out.labels == ["a0", "a1", "b2", "b3"]
    assert out.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert out.metadata == [{"k": 0}, {"k": 1}, {"k": 2}, {"k": 3}]
    # per-token tensors follow their samples, trimmed to the kept responses' width (4)
    assert out.rollout_logp.shape == (4, 4) and out.response_mask.sum(dim=1).tolist() == [1, 2, 3, 4]
    assert out.rollout_logp[2].tolist() == [-3.0, -3.0, -3.0, 0.0]
    assert (m["dynamic_sampling/rounds"], m["dynamic_sampling/drawn_groups"],
            m["dynamic_sampling/zero_signal_groups"], m["dynamic_sampling/filled_groups"],
            m["dynamic_sampling/surplus_groups"]) == (2, 4, 2, 0, 0)
    assert m["dynamic_sampling/drawn_reward_mean"] == pytest.approx(4 / 8)  # 1+0+1+1+0+0+0+1
    # shares and means over all drawn samples (two rounds of 4), counts summed
    assert out.grade_stats == {"accuracy": pytest.approx(4 / 8), "timeouts": 2.0,
                               "overlong_penalty_mean": pytest.approx(0.3)}


def test_surplus_signal_groups_are_left_out():
    out, m, drawn = _run([[1.0, 0.0, 0.0, 1.0, 1.0, 1.0]], needed=1, max_rounds=4)
    assert drawn == [0] and out.labels == ["a0", "a1"]
    assert m["dynamic_sampling/surplus_groups"] == 1
    assert m["dynamic_sampling/zero_signal_groups"] == 1


def test_at_the_round_cap_zero_signal_groups_fill_the_batch():
    out, m, drawn = _run([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 1.0]],
                         needed=2, max_rounds=2)
    assert drawn == [0, 1]  # the third round is never drawn
    # the signal group first, then the earliest zero-signal one
    assert out.labels == ["b0", "b1", "a0", "a1"]
    assert m["dynamic_sampling/filled_groups"] == 1
    assert m["dynamic_sampling/zero_signal_groups"] == 3


def test_one_round_with_enough_signal_is_the_plain_batch():
    out, m, drawn = _run([[1.0, 0.0, 0.0, 1.0]], needed=2, max_rounds=1)
    assert drawn == [0] and out.labels == ["a0", "a1", "a2", "a3"]
    assert m["dynamic_sampling/rounds"] == 1


def _two_rank_worker(rank: int, init_file: str, out_dir: str) -> None:
    from minisparse.grpo.advantages import batch_whiten
    from minisparse.utils.distributed import all_reduce

    with spawned_rank(rank, 2, init_file):
        # rank 0 has its 2 signal groups after one round; rank 1 needs three rounds
        per_rank = {0: [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
                    1: [[0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]]}
        out, metrics, drawn = _run(per_rank[rank], needed=2, max_rounds=5, reduce=all_reduce)
        # the REINFORCE++ whitening over both ranks' samples; rank 1's values doubled, so
        # each rank's own mean and std differ from the pair's
        whitened = batch_whiten(out.rewards * (rank + 1), out.response_mask.sum(dim=1),
                                reduce=all_reduce)
        result = (len(out), out.labels, drawn, dict(metrics), whitened.tolist())
        with open(f"{out_dir}/rank{rank}.pkl", "wb") as fh:
            pickle.dump(result, fh)


def test_two_ranks_draw_in_lockstep_and_end_with_equal_batches(tmp_path):
    import torch.multiprocessing as mp

    from minisparse.grpo.advantages import batch_whiten

    mp.spawn(_two_rank_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    r0, r1 = (pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in (0, 1))
    assert r0[0] == r1[0] == 4  # the same number of samples on both ranks
    assert r0[2] == r1[2] == [0, 1, 2]  # rank 0 keeps drawing while rank 1 is short
    assert r0[1] == ["a0", "a1", "a2", "a3"]
    assert r1[1] == ["a2", "a3", "c0", "c1"]
    assert r0[3]["dynamic_sampling/surplus_groups"] == 0 and r1[3]["dynamic_sampling/filled_groups"] == 0
    # whitened over the 8 samples of both ranks = one process whitening all of them
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 2.0])
    lengths = torch.tensor([1, 2, 3, 4, 3, 4, 1, 2])
    whole = batch_whiten(rewards, lengths).tolist()
    assert r0[4] + r1[4] == pytest.approx(whole, abs=1e-6)


def test_the_keys_are_checked():
    cfg = load_config("tiny_rkv", ["dynamic_sampling=true", "dynamic_sampling_max_rounds=3"])
    assert cfg.dynamic_sampling and cfg.dynamic_sampling_max_rounds == 3
    with pytest.raises(ConfigError, match="'dynamic_sampling_max_rounds' must be >= 1, got 0"):
        load_config("tiny_rkv", ["dynamic_sampling_max_rounds=0"])
