"""Pre-flight checks: each bad input fails with one message naming it, before any model
loads (tests/train/test_train.py runs train.py on the same inputs and sees exit 2)."""
import json
from pathlib import Path

import pytest

from minisparse.config.load import load_config, shipped_configs
from minisparse.config.schema import Config, ConfigError
from minisparse.data.benchmarks import BenchmarkError
from minisparse.data.datasets import DataError
from minisparse.trainer.checkpoint import MARKER, CheckpointError
from minisparse.trainer.preflight import Checked, PreflightError, check_run, check_world
from minisparse.trainer.run_lock import LOCK_FILE, RunLockError


def _cfg(tmp_path: Path, *overrides: str):
    return load_config("tiny_rkv", [f"output_dir={tmp_path / 'out'}", *overrides])


def _data(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _checkpoint(out: Path, rollout: int, world: int, complete: bool = True) -> Path:
    d = out / "checkpoints" / f"rollout_{rollout:06d}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"rollout": rollout, "world_size": world}))
    if complete:
        (d / MARKER).write_text("done\n")
    return d


def _passed(cfg: Config, world: int, resume_required: bool) -> Checked:
    """check_run as train.py calls it once, the folder released after (a test calls it
    again in the same process)."""
    checked = check_run(cfg, world, resume_required)
    checked.lock.release()
    return checked


def test_a_good_run_passes_and_makes_its_output_dir(tmp_path):
    good = _data(tmp_path, '{"prompt": "1+1?", "label": "2"}')
    checked = _passed(_cfg(tmp_path, f"data.path={good}"), 1, resume_required=False)
    assert checked.eval_problems is None and checked.resume_from is None
    # the write probe is gone; the lock file stays, empty once released, beside the
    # run's settings (config.yaml, what a later run in the folder is compared with)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [LOCK_FILE, "config.yaml"]


def test_a_failed_check_leaves_the_folder_free(tmp_path):
    with pytest.raises(CheckpointError):
        check_run(_cfg(tmp_path), 1, resume_required=True)  # nothing to resume from
    _passed(_cfg(tmp_path), 1, resume_required=False)  # not refused as held


@pytest.mark.parametrize("lines,error,message", [
    (['{"prompt": "a", "label": "1"}', '{"prompt": "b", "label": '], DataError,
     "d.jsonl:2: invalid JSON"),  # data.strict (below)
    ([], DataError, "d.jsonl: no rows (empty file)"),
    (['{"question": "a", "label": "1"}'], DataError,
     "d.jsonl:1: missing key 'prompt' (keys present: label, question)"),
    (['{"prompt": "a", "answer": "1"}'], DataError, "d.jsonl:1: missing key 'label'"),
])
def test_bad_data_is_named_with_file_and_line(tmp_path, lines, error, message):
    cfg = _cfg(tmp_path, f"data.path={_data(tmp_path, *lines)}", "data.strict=true")
    with pytest.raises(error) as info:
        check_run(cfg, 1, resume_required=False)
    assert message in str(info.value)


def test_unusable_rows_are_left_out_in_one_line_before_any_model_loads(tmp_path, capsys):
    """Said once, with the count of all and the first file:line of each reason, and kept
    with the run (train.py logs checked.left_out.metrics() with every rollout)."""
    path = _data(tmp_path, '{"prompt": "a", "label": "1"}', '{"prompt": "b", "label": ""}',
                 '{"prompt": "c", "label": NaN}', '{"prompt": "d", "label": ""}')
    checked = _passed(_cfg(tmp_path, f"data.path={path}"), 1, resume_required=False)
    assert capsys.readouterr().out == (
        f"data: 3 of 4 rows left out (cannot be trained on): 2 without a label (first: "
        f"{path}:2), 1 with a NaN or infinite label ({path}:3); data.strict=true stops at "
        f"such a row instead\n")
    assert checked.left_out.metrics() == {"data/rows": 4.0, "data/rows_left_out": 3.0}
    path = _data(tmp_path, '{"prompt": "a", "label": ""}', '{"prompt": "b"')
    with pytest.raises(DataError) as info:  # nothing left to train on
        check_run(_cfg(tmp_path, f"data.path={path}"), 1, resume_required=False)
    assert str(info.value) == (f"{path}: no usable rows: all 2 left out (1 without a label "
                               f"(first: {path}:1), 1 not valid JSON ({path}:2))")


def test_a_dtype_the_accelerator_refuses_is_named_before_any_model_loads(tmp_path,
                                                                         monkeypatch):
    """DeepSpeed's CPU accelerator takes float16 only on CPUs with AVX512-FP16 or AMX (an
    AMD EPYC has neither): refused here in one line, not by deepspeed.initialize's
    traceback, with the folder left untouched."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    monkeypatch.setattr(type(accelerator), "is_fp16_supported", lambda self: False)
    with pytest.raises(PreflightError) as info:
        check_run(_cfg(tmp_path, "model.dtype=float16"), 1, resume_required=False)
    where = accelerator.device_name()
    assert str(info.value) == (
        f"model.dtype=float16: DeepSpeed's {where} accelerator does not train in float16 on "
        f"this machine{' (its CPU has no AVX512-FP16 or AMX)' if where == 'cpu' else ''}; "
        f"use --set model.dtype=bfloat16 or --set model.dtype=float32")
    assert not (tmp_path / "out").exists()
    _passed(_cfg(tmp_path, "model.dtype=float32"), 1, resume_required=False)


def test_each_shipped_config_reads_its_own_data(shared_data, tmp_path, capsys):
    """Every shipped config whose data.path names one of the real training files passes
    the pre-flight on that file (the model is the tiny one: the checkpoints are not
    here, and the pre-flight reads no weights; the held-out benchmarks are read from the
    shared eval folder). The paper's files each hold two rows without a label, which are
    left out."""
    files = {p.name: p for p in (shared_data / "train").glob("*.jsonl")}
    checked = {}
    for name in shipped_configs():
        data = Path(load_config(name).data.path).name
        if data not in files:
            continue
        cfg = load_config(name, [f"data.path={files[data]}", "model.path=tiny",
                                 f"eval.data_dir={shared_data / 'eval'}",
                                 f"output_dir={tmp_path / name}"])
        checked[name] = _passed(cfg, 1, resume_required=False).left_out
        assert f"without a label (first: {files[data]}:5055)" in capsys.readouterr().out
    assert {"qwen3b_rkv", "qwen3b_dense", "llama1b_rkv", "coder1.5b_rkv"} <= set(checked)
    assert {n: (c.rows, c.usable) for n, c in checked.items()} == {
        n: (8523, 8521) for n in checked}


def test_missing_paths_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="model path '/nonexistent/model'"):
        check_run(_cfg(tmp_path, "model.path=/nonexistent/model"), 1, False)
    (tmp_path / "file").write_text("")
    cfg = load_config("tiny_rkv", [f"output_dir={tmp_path / 'file' / 'out'}"])
    with pytest.raises(RunLockError) as info:
        check_run(cfg, 1, False)
    assert str(info.value) == f"output_dir: cannot write to {tmp_path}/file/out: Not a directory"
    missing = tmp_path / "no-eval-data"
    cfg = _cfg(tmp_path, "eval_interval=1", "eval.benchmarks=gsm8k", f"eval.data_dir={missing}")
    with pytest.raises(BenchmarkError, match=str(missing)):
        check_run(cfg, 1, False)
    assert _passed(_cfg(tmp_path, f"eval.data_dir={missing}"), 1, False).eval_problems is None


def test_resume_takes_the_newest_complete_checkpoint_of_any_number_of_ranks(tmp_path,
                                                                              capsys):
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="--resume: no complete checkpoint under"):
        check_run(_cfg(tmp_path), 1, resume_required=True)
    _checkpoint(out, 3, world=1, complete=False)  # killed mid-save
    unfinished = "rollout_000003 is incomplete (no COMPLETE: its save never finished)"
    with pytest.raises(CheckpointError) as info:
        check_run(_cfg(tmp_path), 1, resume_required=True)
    assert str(info.value) == (f"--resume: no complete checkpoint under {out}/checkpoints; "
                               f"{unfinished}")
    assert _passed(_cfg(tmp_path), 1, resume_required=False).resume_from is None
    assert capsys.readouterr().out.splitlines() == [
        f"checkpoint {unfinished}; starting from the first rollout"]
    _checkpoint(out, 1, world=1)
    newest = _checkpoint(out, 2, world=1)
    assert _passed(_cfg(tmp_path), 1, resume_required=True).resume_from == newest
    assert capsys.readouterr().out.splitlines()[0] == (
        f"checkpoint {unfinished}; resuming from rollout_000002")
    assert _passed(_cfg(tmp_path), 1, resume_required=False).resume_from == newest  # auto
    assert _passed(_cfg(tmp_path, "resume=never"), 1, False).resume_from is None
    newest = _checkpoint(out, 4, world=2)  # resharded when it loads (trainer/universal.py)
    assert _passed(_cfg(tmp_path), 1, resume_required=True).resume_from == newest
    with pytest.raises(CheckpointError, match="rollout_000004 was saved by 2 processes and "
                                              "this run has 1: resharding ZeRO 3"):
        check_run(_cfg(tmp_path, "zero_stage=3"), 1, resume_required=False)


def test_batch_sizes_must_split_over_ranks():
    check_world(Config(rollout_batch_size=8, global_batch_size=16), 4)
    with pytest.raises(ConfigError, match="'rollout_batch_size' \\(6\\)"):
        check_world(Config(rollout_batch_size=6, global_batch_size=16), 4)
    with pytest.raises(ConfigError, match="'global_batch_size'"):
        check_world(Config(rollout_batch_size=8, global_batch_size=12), 8)
