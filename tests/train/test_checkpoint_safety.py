"""What a resume trusts: nothing it loads runs code, a damaged checkpoint is named and the
one before it taken, a changed data set is refused before the model loads, and a full
disk stops the run in one line with every complete checkpoint and metrics.jsonl intact.

One tiny run of two rollouts (a checkpoint after each) is trained once; each test works
on a copy of it."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train import BASE, REPO, _cmd, _env, _rows, _train

from minisparse.config.load import load_config
from minisparse.trainer.checkpoint import (MARKER, CheckpointError, check_pickles, damage,
                                           latest_checkpoint, load_checkpoint, seal)
from minisparse.trainer.manifest import MANIFEST
from minisparse.trainer.preflight import resume_checkpoint
from minisparse.trainer.train_engine import unsupported_dtype

TWO = ["--set", "num_rollout=2", "--set", "save_interval=1"]
THREE = ["--set", "num_rollout=3", "--set", "save_interval=1"]
STATE_FILES = ["rng_rank0.pt", "ds/state/mp_rank_00_model_states.pt",
               "ds/state/zero_pp_rank_0_mp_rank_00_optim_states.pt"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, _minisparse_cache) -> Path:
    out = tmp_path_factory.mktemp("safety") / "run"
    res = _train(out, *TWO, cache=_minisparse_cache)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run's output_dir, free to damage."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def _ckpt(out: Path, n: int) -> Path:
    return out / "checkpoints" / f"rollout_{n:06d}"


class Planted:
    """Unpickling it writes `marker`: what a crafted checkpoint file could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _reseal(ckpt: Path) -> None:
    """A manifest matching the changed files: anyone who can plant a file can write one."""
    (ckpt / MARKER).unlink()
    (ckpt / MANIFEST).unlink()
    seal(ckpt, int(ckpt.name.split("_")[1]))


@pytest.mark.parametrize("name", STATE_FILES)
def test_a_planted_pickle_is_refused_unloaded(run, tmp_path, _minisparse_cache, name):
    """A plain rerun resumes (resume: auto); a state file whose pickle would run code
    stops it with one line naming the file, and the code never runs."""
    ckpt, marker = _ckpt(run, 2), tmp_path / "ran"
    torch.save(Planted(marker), ckpt / name)
    _reseal(ckpt)
    res = _train(run, *THREE, cache=_minisparse_cache)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.splitlines() == [
        f"error: {ckpt / name}: not loaded: it holds more than tensors and plain data "
        f"(Unsupported global: GLOBAL exec) and unpickling it could run code; the previous "
        f"complete checkpoint is rollout_000001; to resume from it: mv {ckpt} "
        f"{ckpt.parent / 'refused_rollout_000002'} && python "
        f"{shlex.join(_cmd(run, *THREE)[1:])}"]
    assert not marker.exists()


class Blocked:
    """A pickle calling os.system: torch refuses its module outright, in a message that
    advises loading the file with weights_only=False (which would run it)."""

    def __reduce__(self):
        return os.system, ("true",)


def test_a_refused_checkpoint_names_the_one_before_it_and_never_the_unsafe_load(run):
    ckpt = _ckpt(run, 2)
    torch.save(Blocked(), ckpt / STATE_FILES[0])
    _reseal(ckpt)
    with pytest.raises(CheckpointError) as info:
        resume_checkpoint(_cfg(run), False, 64)
    aside = ckpt.parent / "refused_rollout_000002"
    assert str(info.value).startswith(
        f"{ckpt / STATE_FILES[0]}: not loaded: it holds more than tensors and plain data "
        f"(Trying to load unsupported GLOBAL posix.system whose module posix is blocked) and "
        f"unpickling it could run code; the previous complete checkpoint is rollout_000001; "
        f"to resume from it: mv {ckpt} {aside} && python ")
    assert "weights_only" not in str(info.value)
    ckpt.rename(aside)  # as the line says: the same command then resumes from rollout 1
    assert resume_checkpoint(_cfg(run), False, 64) == _ckpt(run, 1)
    torch.save(Blocked(), _ckpt(run, 1) / STATE_FILES[0])
    _reseal(_ckpt(run, 1))
    with pytest.raises(CheckpointError, match="could run code; no complete checkpoint "
                                              "before it to resume from: give a new "
                                              "output_dir$"):
        resume_checkpoint(_cfg(run), False, 64)


def test_load_checkpoint_checks_each_file_before_deepspeed_reads_it(run, tmp_path):
    """The check is load_checkpoint's own too, for callers without the pre-flight."""
    ckpt, marker = _ckpt(run, 1), tmp_path / "ran"
    torch.save(Planted(marker), ckpt / STATE_FILES[2])
    with pytest.raises(CheckpointError, match="optim_states.pt: not loaded"):
        load_checkpoint(ckpt, train_engine=None)  # refused before the engine is touched
    assert not marker.exists()


@pytest.mark.parametrize("keys", [["zero_stage=1", "model.dtype=bfloat16"],
                                  ["zero_stage=3", "model.dtype=float16"]],
                         ids=["zero1-bf16", "zero3-fp16"])
def test_the_allow_list_takes_every_file_deepspeed_writes(tmp_path, _minisparse_cache, keys):
    """ZeRO 2 fp32 resumes in test_train.py; ZeRO 1 with bf16 (bf16_* optimizer files,
    the static loss scaler, fragment addresses) and ZeRO 3 with fp16 (dynamic loss
    scaler, per-rank model states) pass the weights-only check as DeepSpeed writes them.
    fp16 only where DeepSpeed's accelerator trains in it (a CPU without AVX512-FP16 or
    AMX, such as an AMD EPYC, does not: the run would stop at its pre-flight)."""
    for dtype in (k.split("=")[1] for k in keys if k.startswith("model.dtype=")):
        if why := unsupported_dtype(dtype):
            pytest.skip(f"model.dtype={dtype}: {why}")
    out = tmp_path / "run"
    res = _train(out, "--set", "num_rollout=1", *[a for k in keys for a in ("--set", k)],
                 cache=_minisparse_cache)
    assert res.returncode == 0, res.stderr[-3000:]
    check_pickles(latest_checkpoint(out))


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)


def _legacy(ckpt: Path) -> None:
    """As saved before manifests: no MANIFEST.json, a COMPLETE that records none."""
    (ckpt / MANIFEST).unlink()
    (ckpt / MARKER).write_text("rollout 2\n")


def _size(ckpt: Path, name: str) -> int:
    return json.loads((ckpt / MANIFEST).read_text())["files"][name]["size"]


OPTIM = STATE_FILES[2]
DAMAGE = {  # what is done to the newest checkpoint -> the reason its line gives
    "model safetensors truncated": (
        lambda c: (c / "hf/model.safetensors").write_bytes(b"x" * 1234),
        lambda c: f"hf/model.safetensors: size 1234, manifest says "
                  f"{_size(c, 'hf/model.safetensors')}"),
    "DeepSpeed state byte flipped": (
        lambda c: _flip_a_byte(c / OPTIM),
        lambda c: f"{OPTIM}: sha256 differs from the manifest"),
    "rng file missing": (lambda c: (c / "rng_rank0.pt").unlink(),
                         lambda c: "rng_rank0.pt: missing"),
    "manifest corrupt": (lambda c: (c / MANIFEST).write_text("{"),
                         lambda c: f"{MANIFEST}: sha256 differs from the one COMPLETE records"),
    "manifest missing": (lambda c: (c / MANIFEST).unlink(), lambda c: f"{MANIFEST}: missing"),
    "trainer_state.json corrupt": (
        lambda c: (c / "trainer_state.json").write_text('{"rollout": '),
        lambda c: f"trainer_state.json: size 12, manifest says {_size(c, 'trainer_state.json')}"),
    "trainer_state.json corrupt, saved before manifests": (
        lambda c: (_legacy(c), (c / "trainer_state.json").write_text('{"rollout": ')),
        lambda c: "trainer_state.json: not JSON (Expecting value: line 1 column 13 (char 12))"),
}


def _cfg(out: Path, *keys: str):
    """The trained run's config (test_train's BASE: its settings are checked on resume),
    `keys` on top."""
    sets = [a for a in BASE[2:] if a != "--set"]
    return load_config("tiny_rkv", [*sets, f"output_dir={out}", *keys])


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_checkpoint_is_named_and_the_one_before_it_taken(run, capsys, case):
    ckpt = _ckpt(run, 2)
    damage_it, reason = DAMAGE[case]
    why = reason(ckpt)  # read before the damage (the manifest may go)
    damage_it(ckpt)
    assert resume_checkpoint(_cfg(run), False, 64) == _ckpt(run, 1)
    assert capsys.readouterr().out.splitlines() == [
        f"checkpoint rollout_000002 is damaged ({why}); resuming from rollout_000001"]


@pytest.mark.parametrize("case", ["DeepSpeed state byte flipped", "trainer_state.json corrupt"])
def test_a_run_goes_on_from_the_checkpoint_before_a_damaged_one(run, _minisparse_cache, case):
    """A plain rerun: the same line, then rollouts 2 and 3 trained after rollout 1, a
    sound rollout_000002 in place of the damaged one. (A corrupt trainer_state.json made
    every later launch in the folder a traceback.)"""
    ckpt = _ckpt(run, 2)
    damage_it, reason = DAMAGE[case]
    why = reason(ckpt)
    damage_it(ckpt)
    res = _train(run, *THREE, cache=_minisparse_cache)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[0] == f"checkpoint rollout_000002 is damaged ({why}); resuming from rollout_000001"
    assert f"resumed from {_ckpt(run, 1)} (rollout 1, step 2)" in lines
    assert [r["rollout"] for r in _rows(run)] == [1, 2, 3]
    assert damage(ckpt) is None and damage(_ckpt(run, 3)) is None


def test_with_no_usable_checkpoint_resume_stops_naming_why(run, _minisparse_cache):
    for n in (1, 2):
        (_ckpt(run, n) / "hf/model.safetensors").write_bytes(b"")
    size = _size(_ckpt(run, 2), "hf/model.safetensors")
    why = f"rollout_000002 is damaged (hf/model.safetensors: size 0, manifest says {size})"
    res = _train(run, *THREE, "--resume", cache=_minisparse_cache)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"error: --resume: no usable checkpoint under {run}/checkpoints: {why}; 1 older one "
        f"is damaged too; give a new output_dir to start over"]
    # resume: auto stops too: starting over would drop the folder's metrics.jsonl rows
    with pytest.raises(CheckpointError, match=f"^resume=auto: no usable checkpoint under "
                                              f".*: {re.escape(why)}"):
        resume_checkpoint(_cfg(run), False, 64)


def test_a_checkpoint_from_before_manifests_resumes_unverified(run, capsys):
    _legacy(_ckpt(run, 2))
    assert resume_checkpoint(_cfg(run), True, 64) == _ckpt(run, 2)
    assert capsys.readouterr().out == ("checkpoint rollout_000002 has no MANIFEST.json (saved "
                                       "before manifests): resuming from it unverified\n")


@pytest.mark.parametrize("keys,message", [
    (["seed=7"], "was trained with seed=42 and this run has seed=7: its prompt order would "
                 "change; resume with --set seed=42 or give a new output_dir"),
    (["data.shuffle=false"], "was trained with data.shuffle=true and this run has "
                             "data.shuffle=false: its prompt order would change; resume with "
                             "--set data.shuffle=true or give a new output_dir"),
], ids=["seed", "shuffle"])
def test_a_changed_sampler_setting_is_named(run, keys, message):
    with pytest.raises(CheckpointError) as info:
        resume_checkpoint(_cfg(run, *keys), False, 64)
    assert str(info.value) == f"checkpoint rollout_000002 {message}"


@pytest.fixture(scope="module")
def broken_model(tmp_path_factory) -> Path:
    """Passes the path check, fails to load: a refusal after loading would show it."""
    d = tmp_path_factory.mktemp("broken-model")
    (d / "config.json").write_text("{}")
    return d


def test_a_smaller_data_set_is_refused_before_the_model_loads(run, _minisparse_cache,
                                                               broken_model):
    res = _train(run, *THREE, "--set", "data.synthetic_size=32", "--set",
                 f"model.path={broken_model}", cache=_minisparse_cache)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        "error: checkpoint rollout_000002 was trained on 64 prompts and this run's data "
        "(data.synthetic_size) has 32: the data set changed; resume with the data it was "
        "trained on or give a new output_dir"]


def test_a_larger_data_set_is_refused_in_one_line(run, _minisparse_cache):
    """More rows than the checkpoint's: dropped prompts could explain it until they are
    tokenized, so this one is caught once the model is loaded, before any rollout."""
    res = _train(run, *THREE, "--set", "data.synthetic_size=128", cache=_minisparse_cache)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        "error: checkpoint rollout_000002 does not fit this run's data (sampler state has "
        "num_rows=64, this run has 128: the dataset or seed changed); resume with the data, "
        "data.max_prompt_len and seed it was trained with, or give a new output_dir"]
    assert [r["rollout"] for r in _rows(run)] == [1, 2]


NO_SPACE = """
import errno, runpy, sys, torch
real = torch.save
def save(obj, f, *args, **kwargs):
    if ".tmp_rollout_000003" in str(f) and str(f).endswith("rng_rank0.pt"):
        raise OSError(errno.ENOSPC, "No space left on device", str(f))
    return real(obj, f, *args, **kwargs)
torch.save = save
sys.argv, sys.path[0] = sys.argv[1:], "."  # as `python train.py ...` in the repo
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_full_disk_stops_the_run_in_one_line_and_leaves_the_rest(run, tmp_path,
                                                                   _minisparse_cache):
    """The third rollout's save runs out of space (after DeepSpeed wrote its files): one
    line naming the folder, the disk and its space, exit 1; both checkpoints and the
    metrics rows intact, the partial save gone. A crash's leftovers go at the next start."""
    rows = (run / "metrics.jsonl").read_text()
    wrapper = tmp_path / "no_space.py"
    wrapper.write_text(NO_SPACE)
    res = subprocess.run([sys.executable, str(wrapper), *_cmd(run, *THREE)[1:]], cwd=REPO,
                         env=_env(_minisparse_cache), capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 1, res.stderr[-3000:]
    (line,) = res.stderr.splitlines()
    root = run / "checkpoints"
    assert line.startswith(f"error: disk full: checkpoint rollout_000003 could not be saved "
                           f"in {root} (disk /")
    assert re.search(r" free of [0-9.]+ [KMG]iB; a checkpoint takes [0-9.]+ MiB\); ", line)
    assert line.endswith("the complete checkpoints and metrics.jsonl are intact: free "
                         "space, then run the same command to resume")
    assert sorted(p.name for p in root.iterdir()) == ["rollout_000001", "rollout_000002"]
    assert damage(_ckpt(run, 1)) is None and damage(_ckpt(run, 2)) is None
    assert (run / "metrics.jsonl").read_text().startswith(rows)
    assert [r["rollout"] for r in _rows(run)] == [1, 2, 3]
    for stale in (".tmp_rollout_000003", ".del_rollout_000001"):  # as a SIGKILL leaves
        (root / stale / "ds").mkdir(parents=True)
    again = _train(run, *THREE, cache=_minisparse_cache)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (f"removed .del_rollout_000001, .tmp_rollout_000003 from {root}: left by an "
            f"interrupted save") in again.stdout.splitlines()
    assert sorted(p.name for p in root.iterdir()) == [f"rollout_00000{n}" for n in (1, 2, 3)]
    assert [r["rollout"] for r in _rows(run)] == [1, 2, 3]
