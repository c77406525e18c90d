"""One output_dir, one run: a command with other settings stops instead of passing for the
finished run (or continuing its checkpoint), and `python eval.py --run OUTPUT_DIR`, the
command a finished run prints, scores the run on its own task beside its base model.

One tiny run of one rollout is trained once (plain tiny_rkv, as a newcomer runs it)."""
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_train import REPO, _env


def _command(words: list[str], cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *words], cwd=REPO, env=_env(cache),
                          capture_output=True, text=True, timeout=600)


def _train(out: Path, *sets: str, cache: Path) -> subprocess.CompletedProcess:
    args = [a for key in ("num_rollout=1", f"output_dir={out}", *sets) for a in ("--set", key)]
    return _command(["train.py", "--config", "tiny_rkv", *args], cache)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, _minisparse_cache) -> tuple[Path, str]:
    """(output_dir, stdout) of a finished one-rollout tiny run."""
    out = tmp_path_factory.mktemp("folder") / "tiny"
    res = _train(out, cache=_minisparse_cache)
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res.stdout


def test_other_settings_stop_with_one_line_same_settings_say_finished(finished,
                                                                      _minisparse_cache):
    out, _ = finished
    res = _train(out, "compress.algorithm=knorm", cache=_minisparse_cache)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"error: {out} holds a run trained with other settings (compress.algorithm rkv -> "
        f"knorm); to train this one, give it its own folder: --set output_dir={out}_knorm"]
    again = _train(out, cache=_minisparse_cache)
    assert again.returncode == 0
    assert f"{out} already holds a finished run: 1 of 1 rollouts" in again.stdout


def test_more_rollouts_resume_but_not_with_another_algorithm(finished, tmp_path,
                                                             _minisparse_cache):
    out = Path(shutil.copytree(finished[0], tmp_path / "tiny"))
    res = _train(out, "num_rollout=2", "loss.advantage=gspo", cache=_minisparse_cache)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"error: {out} holds a run trained with other settings (loss.advantage grpo -> gspo); "
        f"to train this one, give it its own folder: --set output_dir={out}_gspo"]
    res = _train(out, "num_rollout=2", "engine.max_num_seqs=8", cache=_minisparse_cache)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout and "rollout 2/2" in res.stdout


def test_the_printed_eval_command_scores_the_run_beside_its_base(finished,
                                                                  _minisparse_cache):
    out, stdout = finished
    line = next(l for l in stdout.splitlines() if l.startswith("score it: "))
    command = line[len("score it: "):].split("  (")[0]
    assert command == f"python eval.py --run {out}"
    res = _command(shlex.split(command)[1:], _minisparse_cache)
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("average accuracy: 0.0% for rollout_000001, 0.0% for the base model tiny (its "
            f"results in {out}/eval/quick/base)") in res.stdout
    # then both side by side, the checkpoint's paired difference from its base (both 0%)
    table = res.stdout[res.stdout.index("| benchmark"):].splitlines()
    assert table[0] == "| benchmark (problems x samples, length) | base | rollout_000001 |"
    assert table[2].startswith("| arithmetic (50 x 4, <= 48 tokens) | 0.0 ± 0.0 (")
    assert table[2].endswith("; Δ +0.0 ± 0.0 |")
    for name in ("rollout_000001", "base"):
        result = json.loads((out / "eval/quick" / name / "arithmetic/metrics.json").read_text())
        assert result["settings"]["prompt_template"] == "boxed"  # tiny_rkv's rows: no chat
        assert (result["metrics"]["n_samples"], result["settings"]["max_new_tokens"]) == (4, 48)
        questions = [json.loads(l)["question"] for l in
                     (out / "eval/quick" / name / "arithmetic/samples.jsonl").open()]
        assert result["metrics"]["problems"] == len(set(questions)) == 50
    again = _command(shlex.split(command)[1:], _minisparse_cache)  # both cached: no generation
    assert again.returncode == 0 and again.stdout.count("finished earlier") == 2


def test_run_without_a_recorded_config_or_checkpoint_exits_2(tmp_path, _minisparse_cache):
    res = _command(["eval.py", "--run", str(tmp_path)], _minisparse_cache)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"eval.py: error: --run {tmp_path}: no config.yaml: not a training run's output_dir, "
        f"or one from before runs recorded their config (score its checkpoint with --model "
        f"and --config)"]
