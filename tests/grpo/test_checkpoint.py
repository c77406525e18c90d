import json

import torch

from minisparse.grpo.checkpoint import MARKER, latest_checkpoint, rng_state, set_rng_state


def _ckpt(root, name, complete=True):
    d = root / "checkpoints" / name
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"rollout": 1}))
    if complete:
        (d / MARKER).write_text("done\n")
    return d


def test_latest_complete_checkpoint_wins(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    _ckpt(tmp_path, "rollout_000002")
    newest = _ckpt(tmp_path, "rollout_000010")
    _ckpt(tmp_path, "rollout_000012", complete=False)  # killed before the marker
    _ckpt(tmp_path, ".tmp_rollout_000014")  # killed before the rename
    _ckpt(tmp_path, "rollout_000009")
    assert latest_checkpoint(tmp_path) == newest


def test_rng_state_roundtrip():
    state = rng_state()
    a = torch.rand(3)
    torch.rand(5)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), a)
