"""Resharding a checkpoint for another number of processes: the parts that need no
engine (tests/train/test_train_reshard.py resumes real runs 4 -> 2 and 2 -> 4)."""
import pytest

from minisparse.trainer.universal import refusal, reshard_line, saved_world_size, universal_copy


def test_the_line_names_both_world_sizes_and_the_ranks_without_rng(tmp_path):
    ckpt = tmp_path / "rollout_000002"
    assert reshard_line(ckpt, 4, 2) == (f"checkpoint {ckpt} was written by 4 processes and "
                                        f"is resharded for 2 (DeepSpeed universal checkpoint)")
    assert reshard_line(ckpt, 2, 3).endswith(
        "for 3 (DeepSpeed universal checkpoint); rank 2 had no RNG state saved and starts "
        "from a fresh one (seed + rank)")
    assert reshard_line(ckpt, 1, 4) == (f"checkpoint {ckpt} was written by 1 process and "
                                        f"is resharded for 4 (DeepSpeed universal "
                                        f"checkpoint); ranks 1-3 had no RNG state saved and "
                                        f"start from fresh ones (seed + rank)")


def test_only_zero_3_refuses_another_world_size():
    for stage in ("auto", 0, 1, 2):
        assert refusal(stage, 4, 2) is None
    assert refusal(3, 2, 2) is None
    assert refusal(3, 4, 2) == ("was saved by 4 processes and this run has 2: resharding "
                                "ZeRO 3 state is not supported, so resume with torchrun "
                                "--nproc_per_node 4 or zero_stage 1 or 2")
    assert refusal(3, 1, 2).startswith("was saved by 1 process and this run has 2")


def test_a_checkpoint_without_its_world_size_is_taken_for_this_runs():
    assert saved_world_size({"rollout": 3}, 2) == 2
    assert saved_world_size({"rollout": 3, "world_size": 4}, 2) == 4


def test_a_failed_conversion_is_raised_and_leaves_no_copy(tmp_path):
    """Raised on every rank (here the one), so no rank waits for a copy; nothing stays."""
    ckpt = tmp_path / "checkpoints" / "rollout_000001"
    (ckpt / "ds" / "state").mkdir(parents=True)  # no DeepSpeed files in it
    with pytest.raises(RuntimeError, match="to a universal checkpoint failed: FileNotFound"):
        with universal_copy(ckpt):
            pass
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["rollout_000001"]
