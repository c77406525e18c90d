"""Resuming on another number of processes (trainer/universal.py), end to end: train.py
under torchrun on the CPU (gloo), the tiny model, ZeRO 1 and 2, 4 -> 2 and 2 -> 4.

One optimizer step per rollout (the whole batch): with several, each step takes each
rank's first share of its samples, another set of samples on another world size. Every
sample is seeded by its place in the global batch, so runs on 2 and on 4 processes draw
the same prompts and responses and take the same steps, up to the order in which the
gradients are summed: an uninterrupted run on the new world size is the reference.
"""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from scripts.ports import free_ports
from test_train import BASE, REPO, _env, _rows

KEYS = ["num_rollout=3", "save_interval=1", "num_steps_per_rollout=1", "global_batch_size=16"]
# max |weight difference| to the uninterrupted run after the resumed steps: measured
# <= 2.0e-8 (float32 reduction order, 2 against 4 ranks: the uninterrupted runs differ
# as much); a resume that lost the Adam moments was 1.3e-4 off after one step.
WEIGHT_ATOL = 1e-6


def _torchrun(out: Path, nproc: int, stage: int, cache: Path,
              *keys: str) -> subprocess.CompletedProcess:
    """train.py on `nproc` gloo processes (one without torchrun), tiny model, KEYS."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(free_ports())] if nproc > 1 else [sys.executable]
    sets = [*KEYS, f"zero_stage={stage}", f"output_dir={out}", *keys]
    cmd = [*launcher, "train.py", *BASE, *[a for key in sets for a in ("--set", key)]]
    res = subprocess.run(cmd, check=False, cwd=REPO, env=_env(cache), capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _state(out: Path, rollout: int) -> dict:
    return json.loads((out / f"checkpoints/rollout_{rollout:06d}/trainer_state.json").read_text())


def _weights(out: Path, rollout: int) -> dict:
    return load_file(out / f"checkpoints/rollout_{rollout:06d}/hf/model.safetensors")


def _digests(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


class Straight:
    """Uninterrupted 3-rollout runs, each made once per module: (stage, world) -> dir."""

    def __init__(self, base: Path, cache: Path) -> None:
        self.base, self.cache, self.done = base, cache, {}

    def __call__(self, stage: int, world: int) -> Path:
        if (stage, world) not in self.done:
            out = self.base / f"straight_zero{stage}_{world}"
            _torchrun(out, world, stage, self.cache)
            self.done[stage, world] = out
        return self.done[stage, world]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, _minisparse_cache) -> Straight:
    return Straight(tmp_path_factory.mktemp("reshard"), _minisparse_cache)


def _resume_from(source: Path, out: Path) -> Path:
    """out with a copy of source's rollout 1 checkpoint as its newest; the copy's path."""
    ckpt = out / "checkpoints" / "rollout_000001"
    shutil.copytree(source / "checkpoints" / "rollout_000001", ckpt)
    return ckpt


def _assert_continues_like(resumed: Path, reference: Path) -> None:
    """Rollouts 2 and 3 as the uninterrupted run: prompts, steps, LR, weights."""
    rows, ref = _rows(resumed), _rows(reference)[1:]
    assert [r["rollout"] for r in rows] == [2, 3]
    for key in ("train/step", "train/lr"):  # the step count and schedule go on
        assert [r[key] for r in rows] == [r[key] for r in ref], key
    for rollout in (2, 3):
        # the sampler's position: the same global batches of prompts were drawn
        assert _state(resumed, rollout)["sampler"] == _state(reference, rollout)["sampler"]
        assert _state(resumed, rollout)["step"] == _state(reference, rollout)["step"] == rollout
        got, want = _weights(resumed, rollout), _weights(reference, rollout)
        assert max((got[k] - want[k]).abs().max().item() for k in want) <= WEIGHT_ATOL


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("saved,world", [(4, 2), (2, 4)])
def test_resume_on_another_number_of_processes(tmp_path, _minisparse_cache, straight,
                                               stage, saved, world):
    """A checkpoint of `saved` processes continues on `world`: resharded through a
    universal copy (removed after; the checkpoint itself untouched), and rollouts 2-3 as
    an uninterrupted run on `world` processes has them."""
    out = tmp_path / "resumed"
    ckpt = _resume_from(straight(stage, saved), out)
    before = _digests(ckpt)
    res = _torchrun(out, world, stage, _minisparse_cache)
    line = (f"checkpoint {ckpt} was written by {saved} processes and is resharded for "
            f"{world} (DeepSpeed universal checkpoint)")
    if world > saved:
        line += "; ranks 2-3 had no RNG state saved and start from fresh ones (seed + rank)"
    assert line in res.stdout.splitlines()
    assert _digests(ckpt) == before
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "rollout_000001", "rollout_000002", "rollout_000003"]  # no universal copy left
    assert sorted(p.name for p in (out / "checkpoints/rollout_000003").glob("rng_rank*")) == [
        f"rng_rank{r}.pt" for r in range(world)]
    _assert_continues_like(out, straight(stage, world))


def test_zero_0_resumes_on_another_number_of_processes_as_saved(tmp_path, _minisparse_cache,
                                                                 straight):
    """ZeRO 0 holds the optimizer whole: 2 processes' checkpoint loads in one as saved,
    no resharding. ZeRO 0 and 2, on 1, 2 or 4 processes, take the same steps (up to the
    reduction order, as above), so the reference is ZeRO 2's uninterrupted run on 2.
    (Under ZeRO 0 DeepSpeed reports no gradient norm, which the update counts as a
    non-finite step: hence max_nonfinite_steps.)"""
    source, out = tmp_path / "saved", tmp_path / "resumed"
    lenient = "max_nonfinite_steps=100"
    _torchrun(source, 2, 0, _minisparse_cache, "num_rollout=1", lenient)
    _resume_from(source, out)
    res = _torchrun(out, 1, 0, _minisparse_cache, lenient)
    assert "resharded" not in res.stdout
    _assert_continues_like(out, straight(2, 2))
