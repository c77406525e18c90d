"""Two torchruns as two nodes on localhost (gloo, the tiny model, one process each;
scripts/peer_loss.py): a rank frozen (kill -STOP) or killed (kill -9) mid-rollout or
mid-update ends the other within dist.peer_timeout_s + 30 s, non-zero, with one line
naming it and no traceback; the same commands then resume with every rollout once. A
SIGTERM to a run whose peer is dead ends it within the stop's limit, saying so."""
import signal
from pathlib import Path

import pytest

from scripts import peer_loss


PEER_TIMEOUT_S = 10


def setup(cache: Path) -> "peer_loss.Setup":
    return peer_loss.Setup("tiny_rkv", ["num_rollout=3", "save_interval=1",
                                        "log.tensorboard=false",
                                        f"dist.peer_timeout_s={PEER_TIMEOUT_S}"],
                           gpus=False, cache=cache)


@pytest.mark.parametrize("case, resume", [("SIGSTOP rollout", True), ("SIGKILL update", True),
                                          ("SIGSTOP update", False), ("SIGKILL rollout", False)])
def test_a_frozen_or_killed_rank_ends_the_run_naming_it_and_the_run_resumes(
        tmp_path, _minisparse_cache, case, resume):
    """The wait for node 0's exit is bounded by the timeout + 30 s (a hang fails the test);
    the resume is the same after either signal in either phase, so two cases check it."""
    result = peer_loss.run_case(case, tmp_path, setup(_minisparse_cache), PEER_TIMEOUT_S,
                                with_resume=resume)
    assert result.code == 1 and not result.traceback, result
    assert result.last.startswith("error: rank 1 (") and " went silent: no heartbeat for " \
        in result.last, result.last
    assert "; the run stopped in rollout 2; saved: " in result.last, result.last
    command = result.last.split("; to continue from it: ")[1]
    assert command.startswith("torchrun --nnodes 2 --node_rank 0 --nproc_per_node 1 "
                              "--master_addr 127.0.0.1 --master_port ")
    assert result.rollouts == ([1, 2, 3] if resume else None)


def test_sigterm_to_a_run_whose_peer_is_dead_ends_it_saying_nothing_was_saved(
        tmp_path, _minisparse_cache):
    """What torchrun does to the others when one worker dies: SIGTERM. The state to save
    (rollout 1's, save_interval 3) needs every rank: the run says it could not save and
    exits within the stop's limit (15 s), where it used to wait for the rollout."""
    result = peer_loss.run_case("sigterm", tmp_path, setup(_minisparse_cache), PEER_TIMEOUT_S)
    assert result.code == 128 + signal.SIGTERM and not result.traceback, result
    assert result.last.startswith(
        "stopped by SIGTERM in rollout 2 before it could save (rank 1 ("), result.last
    assert "has been silent for " in result.last
    assert "; nothing saved yet; to start again: torchrun " in result.last


def test_a_stop_signal_to_one_rank_stops_both_in_the_same_rollout(tmp_path, _minisparse_cache):
    """Node 1's worker alone gets SIGTERM as its log-prob pass starts (a scheduler that
    signals one node first): the stop is passed on through the store, both drop rollout 2
    and save rollout 1 together (save_interval 3 would not have), and resume."""
    sets = setup(_minisparse_cache)
    sets.sets = [*sets.sets, "save_interval=3"]
    result = peer_loss.run_case("SIGTERM logprobs", tmp_path, sets, PEER_TIMEOUT_S)
    assert result.code == 0 and not result.traceback, result
    assert result.last.startswith("stopped by SIGTERM in rollout 2 of 3 (dropped before its "
                                  "update; a resume redoes it) after "), result.last
    assert "/checkpoints/rollout_000001 (rollout 1); to continue from it: torchrun " \
        in result.last
    assert result.rollouts == [1, 2, 3]
