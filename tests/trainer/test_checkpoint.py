import json

import pytest
import torch

from minisparse.trainer.checkpoint import (
    MARKER,
    complete_checkpoints,
    latest_checkpoint,
    prune_checkpoints,
    remove_checkpoint,
    rng_state,
    set_rng_state,
)


def _ckpt(root, name, complete=True):
    d = root / "checkpoints" / name
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"rollout": 1}))
    if complete:
        (d / MARKER).write_text("done\n")
    return d


def _names(root):
    return sorted(p.name for p in (root / "checkpoints").iterdir())


def test_latest_complete_checkpoint_wins(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    _ckpt(tmp_path, "rollout_000002")
    newest = _ckpt(tmp_path, "rollout_000010")
    _ckpt(tmp_path, "rollout_000012", complete=False)  # killed before the marker
    _ckpt(tmp_path, ".tmp_rollout_000014")  # killed before the rename
    _ckpt(tmp_path, ".del_rollout_000001")  # killed while deleting
    _ckpt(tmp_path, "rollout_000009")
    assert latest_checkpoint(tmp_path) == newest


def test_prune_keeps_the_newest_complete_ones(tmp_path):
    for n in (1, 2, 3, 5):
        _ckpt(tmp_path, f"rollout_{n:06d}")
    _ckpt(tmp_path, "rollout_000006", complete=False)  # not a checkpoint: never counted
    newest = tmp_path / "checkpoints" / "rollout_000005"
    deleted = prune_checkpoints(tmp_path, 2, newest)
    assert [p.name for p in deleted] == ["rollout_000002", "rollout_000001"]
    assert _names(tmp_path) == ["rollout_000003", "rollout_000005", "rollout_000006"]
    assert prune_checkpoints(tmp_path, None, newest) == []  # None keeps all
    assert [p.name for p in prune_checkpoints(tmp_path, 1, newest)] == ["rollout_000003"]
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["rollout_000005"]
    assert prune_checkpoints(tmp_path, 1, newest) == []  # never the only complete one


def test_prune_never_deletes_the_checkpoint_just_written(tmp_path):
    """An older run in the same output_dir left higher numbers (resume: never); the new
    checkpoint stays, the newest others fill the rest of the limit."""
    for n in (8, 9):
        _ckpt(tmp_path, f"rollout_{n:06d}")
    new = _ckpt(tmp_path, "rollout_000002")
    prune_checkpoints(tmp_path, 2, new)
    assert _names(tmp_path) == ["rollout_000002", "rollout_000009"]
    with pytest.raises(ValueError, match="save_total_limit"):
        prune_checkpoints(tmp_path, 0, new)


def test_remove_checkpoint_leaves_nothing(tmp_path):
    path = _ckpt(tmp_path, "rollout_000004")
    _ckpt(tmp_path, ".del_rollout_000004")  # an earlier interrupted delete of the same name
    remove_checkpoint(path)
    assert _names(tmp_path) == []


def test_rng_state_roundtrip():
    state = rng_state()
    a = torch.rand(3)
    torch.rand(5)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), a)


def test_zero_and_no_zero_checkpoints_resume_only_as_they_were_saved(tmp_path):
    """A resume across that line loaded nothing of the weights without a word."""
    from minisparse.trainer.checkpoint import saved_under_zero, zero_mismatch

    path = _ckpt(tmp_path, "rollout_000003")
    assert saved_under_zero(path) is None and zero_mismatch(path, 2) is None  # nothing to tell
    ds = path / "ds" / "state"
    ds.mkdir(parents=True)
    (ds / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert saved_under_zero(path) is False
    assert zero_mismatch(path, 0) is None
    for stage in (2, "auto"):
        assert zero_mismatch(path, stage) == (
            f"checkpoint rollout_000003 was saved without ZeRO (zero_stage 0) and this run "
            f"has zero_stage {stage}: their optimizer states do not load into each other; "
            f"resume with --set zero_stage=0 or give a new output_dir")
    (ds / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    assert saved_under_zero(path) is True
    assert zero_mismatch(path, 1) is None and zero_mismatch(path, "auto") is None
    assert zero_mismatch(path, 0) == (
        "checkpoint rollout_000003 was saved under ZeRO and this run has zero_stage 0: their "
        "optimizer states do not load into each other; resume with --set zero_stage=auto or "
        "give a new output_dir")
