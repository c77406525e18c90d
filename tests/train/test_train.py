"""train.py end to end on CPU: the tiny model, two rollouts, checkpoint, resume, faults."""

import json
import os
import re
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minisparse.trainer.checkpoint import complete_checkpoints, latest_checkpoint
from run_helpers import signalled_after_rows
from scripts.ports import free_ports

REPO = Path(__file__).resolve().parents[2]
# entropy_coef > 0 gives every step a gradient even when the random tiny model earns no
# reward, so resume must restore weights and optimizer state to reproduce rollout 3.
BASE = ["--config", "tiny_rkv", "--set", "loss.entropy_coef=0.01", "--set", "save_interval=2"]

REQUIRED_KEYS = [
    "rollout/reward_mean",
    "rollout/accuracy",
    "rollout/response_len_mean",
    "rollout/response_len_max",
    "rollout/truncated_frac",
    "advantage/mean",
    "advantage/std",
    "advantage/zero_signal_groups",
    "train/pg_loss",
    "train/clip_frac",
    "train/kl",
    "train/entropy",
    "train/grad_norm",
    "train/lr",
    "mismatch/rollout_ppl",
    "mismatch/training_ppl",
    "mismatch/kl_k1",
    "mismatch/kl_k3",
    "mismatch/chi2_token",
    "mismatch/chi2_seq",
    "mismatch/ppl_ratio",
    "tis/raw_mean",
    "tis/bounded_mean",
    "tis/truncated_frac",
    "rs/rejected_token_frac",
    "rs/vetoed_seqs",
    "rs/vetoed_frac",
    "compress/compressions_per_sample",
    "compress/evicted_tokens_per_sample",
    "compress/peak_cache_tokens_mean",
    "time/rollout_s",
    "time/step_s",
    "time/update_s",
    "time/logprobs_s",
    "perf/rollout_tokens_per_s",
    "perf/logprobs_tflops",
    "perf/update_tflops",
]
VOLATILE = ("time/", "mem/", "perf/rollout_tokens_per_s", "perf/rollout_prefill_s",
            "perf/rollout_decode_s", "perf/rollout_compress_s", "perf/logprobs_",
            "perf/update_", "reward/grade_s")


LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env(cache: Path, **extra: str) -> dict[str, str]:
    """This process's environment as a user's shell has it: no launcher variables (the
    in-process DeepSpeed tests set them here), the session's cache."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    return {**env, "MINISPARSE_CACHE": str(cache), **extra}


def _cmd(out: Path, *args: str) -> list[str]:
    return [sys.executable, "train.py", *BASE, "--set", f"output_dir={out}", *args]


def _train(out: Path, *args: str, cache: Path, timeout: float = 600,
           **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(out, *args), check=False, cwd=REPO, env=_env(cache, **env),
                          capture_output=True, text=True, timeout=timeout)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _signalled_after(out: Path, rows: int, signum: int, *args: str,
                     cache: Path) -> subprocess.CompletedProcess:
    """A run that gets `signum` as its metrics.jsonl reaches `rows` rows, finished."""
    return signalled_after_rows(_cmd(out, *args), REPO, _env(cache), rows, signum)


EVERY = ["--set", "num_rollout=5", "--set", "save_interval=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, _minisparse_cache):
    """(killed as rollout 2's row is written, before its checkpoint, then --resume;
    straight) output dirs: 5 rollouts, a checkpoint after each; the interrupted run keeps
    two (save_total_limit=2)."""
    base = tmp_path_factory.mktemp("train")
    resumed, straight = base / "resumed", base / "straight"
    limit = [*EVERY, "--set", "save_total_limit=2"]
    killed = _signalled_after(resumed, 2, signal.SIGKILL, *limit, cache=_minisparse_cache)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    newest = latest_checkpoint(resumed)
    assert newest.name == "rollout_000001"  # the resume drops row 2 and trains it again
    assert [r["rollout"] for r in _rows(resumed)] == [1, 2]
    # a later save killed before its marker, and one killed before its rename
    torn = resumed / "checkpoints" / "rollout_000009"
    (torn / "hf").mkdir(parents=True)
    (torn / "trainer_state.json").write_text('{"rollout": 9}')
    (resumed / "checkpoints" / ".tmp_rollout_000010").mkdir()
    second = _train(resumed, *limit, "--resume", cache=_minisparse_cache)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {newest} " in second.stdout
    third = _train(straight, *EVERY, cache=_minisparse_cache)
    assert third.returncode == 0, third.stderr[-3000:]
    # no GPU: no word on a memory plan or GPU kernels; the start report comes first
    assert third.stdout.startswith("config: tiny_rkv, with "), third.stdout[:500]
    assert "memory plan" not in third.stdout and "training passes" not in third.stdout
    return resumed, straight


def test_metrics_rows_have_every_key(runs):
    rows = _rows(runs[1])
    assert [r["rollout"] for r in rows] == [1, 2, 3, 4, 5]
    missing = [k for k in REQUIRED_KEYS if k not in rows[0]]
    assert not missing
    assert rows[0]["train/step"] == 2.0 and rows[2]["train/step"] == 6.0  # 2 steps/rollout
    assert any((runs[1] / "tensorboard").glob("events.out.tfevents.*"))


def test_hf_checkpoint_loads(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = runs[0] / "checkpoints" / "rollout_000005"
    assert (ckpt / "COMPLETE").is_file()
    model = AutoModelForCausalLM.from_pretrained(ckpt / "hf", local_files_only=True)
    AutoTokenizer.from_pretrained(ckpt / "hf", local_files_only=True)
    assert model.config.model_type == "qwen2"


def test_killed_run_resumes_with_same_prompts_weights_and_metrics(runs):
    """Every row of the interrupted-and-resumed run equals the straight run's: one row per
    rollout (rows after the checkpoint were dropped and redone), same prompts and weights."""
    resumed, straight = (_rows(d) for d in runs)
    assert [r["rollout"] for r in resumed] == [1, 2, 3, 4, 5]
    for a, b in zip(resumed, straight):
        same = {k: a[k] for k in a if not k.startswith(VOLATILE)}
        assert same == {k: b[k] for k in same}, a["rollout"]
    state = lambda d: json.loads((d / "checkpoints/rollout_000005/trainer_state.json").read_text())
    assert state(runs[0])["sampler"] == state(runs[1])["sampler"]


def test_save_total_limit_keeps_the_newest_complete_checkpoints(runs):
    resumed, straight = runs
    assert [p.name for p in complete_checkpoints(resumed)] == ["rollout_000004", "rollout_000005"]
    leftovers = sorted(p.name for p in (resumed / "checkpoints").iterdir())
    assert leftovers == ["rollout_000004", "rollout_000005", "rollout_000009"]  # torn one stays
    assert len(complete_checkpoints(straight)) == 5  # no limit: every checkpoint kept


def test_checkpoint_holds_each_weight_copy_once(runs):
    """hf/ has the weights, ds/ the fp32 masters and moments; DeepSpeed's module file keeps
    no parameters (resume rebuilds them from the masters: the test above)."""
    import torch

    ds = runs[0] / "checkpoints" / "rollout_000005" / "ds" / "state"
    module = torch.load(ds / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert not [k for k in module if k.endswith((".weight", ".bias"))]
    optim = torch.load(ds / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    masters = optim["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    hf = runs[0] / "checkpoints" / "rollout_000005" / "hf" / "model.safetensors"
    from safetensors.torch import load_file

    weights = load_file(hf)
    assert sum(m.numel() for m in masters) == sum(w.numel() for w in weights.values())


def test_without_zero_hf_holds_the_weights_and_a_killed_run_resumes_exactly(
        tmp_path, _minisparse_cache):
    """The CPU configs' layout (float32, zero_stage 0): hf/ holds the weights, ds/ AdamW's
    moments and no weights; a killed run resumes from them to the straight run's rows, and
    its end line counts what the resumed process ran. A resume under ZeRO is refused in
    one line (ZeRO's shards and this state do not load into each other)."""
    import torch

    zero0 = ["--set", "zero_stage=0", "--set", "num_rollout=3", "--set", "save_interval=1"]
    resumed, straight = tmp_path / "resumed", tmp_path / "straight"
    killed = _signalled_after(resumed, 2, signal.SIGKILL, *zero0, cache=_minisparse_cache)
    assert killed.returncode == -signal.SIGKILL
    done = int(latest_checkpoint(resumed).name.split("_")[1])
    assert done == 1  # killed as rollout 2's row was written, before its checkpoint
    second = _train(resumed, *zero0, cache=_minisparse_cache)
    assert second.returncode == 0, second.stderr[-3000:]
    assert (f"finished rollouts {done + 1} to 3 ({3 - done} in this run, resumed after "
            f"rollout {done}) in ") in second.stdout
    third = _train(straight, *zero0, cache=_minisparse_cache)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "finished 3 rollouts in " in third.stdout
    for a, b in zip(_rows(resumed), _rows(straight), strict=True):
        same = {k: a[k] for k in a if not k.startswith(VOLATILE)}
        assert same == {k: b[k] for k in same}, a["rollout"]
    ds = resumed / "checkpoints" / "rollout_000003" / "ds" / "state"
    assert [p.name for p in ds.iterdir()] == ["mp_rank_00_model_states.pt"]
    saved = torch.load(ds / "mp_rank_00_model_states.pt", weights_only=False)
    assert not [k for k in saved["module"] if k.endswith((".weight", ".bias"))]
    moments = saved["optimizer"]["state"]
    assert moments and all({"exp_avg", "exp_avg_sq"} <= set(m) for m in moments.values())
    zero = _train(resumed, "--set", "num_rollout=4", "--set", "zero_stage=2",
                  cache=_minisparse_cache)
    assert zero.returncode == 2
    assert zero.stderr == (
        "error: checkpoint rollout_000003 was saved without ZeRO (zero_stage 0) and this "
        "run has zero_stage 2: their optimizer states do not load into each other; resume "
        "with --set zero_stage=0 or give a new output_dir\n")


def test_nonfinite_steps_stop_the_run(tmp_path, _minisparse_cache):
    out = tmp_path / "nan"
    res = _train(
        out,
        "--set",
        "num_rollout=3",
        "--set",
        "loss.entropy_coef=1e308",  # overflows float32: -inf loss
        "--set",
        "max_nonfinite_steps=2",
        cache=_minisparse_cache,
    )
    assert res.returncode != 0
    assert "2 optimizer steps had a non-finite loss" in res.stderr
    rows = _rows(out)
    assert len(rows) == 1 and rows[0]["train/nonfinite_steps"] == 2.0


def test_bad_paths_fail_before_training(tmp_path, _minisparse_cache):
    res = _train(tmp_path / "m", "--set", "model.path=/nonexistent/model", cache=_minisparse_cache)
    assert res.returncode == 2 and "/nonexistent/model" in res.stderr
    res = _train(
        tmp_path / "d", "--set", "data.path=/nonexistent/data.jsonl", cache=_minisparse_cache
    )
    assert res.returncode == 2
    # a file of the user's own: no download to suggest (there is no set called "data")
    assert res.stderr == "error: data.path: no such file: /nonexistent/data.jsonl\n"
    assert not (tmp_path / "m" / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def broken_model(tmp_path_factory) -> Path:
    """A model directory that passes the path check but cannot load: any error that
    surfaces after loading would come out as its traceback instead of the input's line."""
    d = tmp_path_factory.mktemp("broken-model")
    (d / "config.json").write_text("{}")
    return d


BAD_INPUTS = {
    "malformed line, data.strict": ('{"prompt": "a", "label": "1"}\n{"prompt": "b",\n',
                                    ["data.strict=true"], "bad.jsonl:2: invalid JSON"),
    "no usable row": ('{"prompt": "a", "label": ""}\n{"prompt": "b",\n', [],
                      "bad.jsonl: no usable rows: all 2 left out (1 without a label"),
    "empty file": ("", [], "bad.jsonl: no rows (empty file)"),
    "missing key": ('{"prompt": "a", "label": "1"}\n', ["data.input_key=question"],
                    "bad.jsonl:1: missing key 'question' (keys present: label, prompt)"),
    "output dir": ('{"prompt": "a", "label": "1"}\n', ["output_dir={tmp}/bad.jsonl/out"],
                   "output_dir: cannot write to {tmp}/bad.jsonl/out: Not a directory"),
    "eval data": ('{"prompt": "a", "label": "1"}\n',
                  ["eval_interval=1", "eval.benchmarks=gsm8k", "eval.data_dir={tmp}/none"],
                  "{tmp}/none"),
    "reward plug-in": ('{"prompt": "a", "label": "1"}\n', ["reward.function=no_such_module_xyz:f"],
                       "reward.function: cannot import module 'no_such_module_xyz'"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_exits_2_with_one_line_before_the_model_loads(
        tmp_path, _minisparse_cache, broken_model, case):
    text, overrides, message = BAD_INPUTS[case]
    (tmp_path / "bad.jsonl").write_text(text)
    sets = [f"data.path={tmp_path}/bad.jsonl", f"model.path={broken_model}", *overrides]
    args = [arg for key in sets for arg in ("--set", key.format(tmp=tmp_path))]
    res = _train(tmp_path / "out", *args, cache=_minisparse_cache)
    assert res.returncode == 2, res.stderr[-3000:]
    (line,) = res.stderr.splitlines()
    assert line.startswith("error: ") and message.format(tmp=tmp_path) in line


def test_bad_eval_benchmark_fails_before_training(tmp_path, _minisparse_cache):
    """In-training evaluation's benchmarks are read at start-up: a typo fails the run at
    once (naming it), not after eval_interval rollouts with the other ranks waiting."""
    out = tmp_path / "badeval"
    res = _train(out, "--set", "eval_interval=1", "--set", "eval.benchmarks=gsm8k_typo",
                 cache=_minisparse_cache)
    assert res.returncode == 2 and "gsm8k_typo" in res.stderr
    assert not (out / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory) -> Path:
    """Three made-up gsm8k rows in the harness layout (DIR/gsm8k/test.jsonl)."""
    d = tmp_path_factory.mktemp("eval-data")
    rows = [{"question": f"Tom has {i} pens and buys 2 more. How many pens?",
             "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"} for i in range(3)]
    (d / "gsm8k").mkdir()
    (d / "gsm8k" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _eval_args(eval_dir: Path) -> list[str]:
    keys = ["eval_interval=1", "eval.benchmarks=gsm8k", "eval.max_new_tokens=8",
            "eval.n_samples=2", f"eval.data_dir={eval_dir}"]
    return [arg for key in keys for arg in ("--set", key)]


def test_eval_metrics_logged_with_training(tmp_path, _minisparse_cache, eval_dir):
    out = tmp_path / "eval"
    res = _train(out, "--set", "num_rollout=1", "--set", "save_interval=0",
                 *_eval_args(eval_dir), cache=_minisparse_cache)
    assert res.returncode == 0, res.stderr[-3000:]
    row = _rows(out)[0]
    assert row["eval/gsm8k/mean_response_tokens"] <= 8.0 and "eval/average_accuracy" in row
    assert not (out / "checkpoints").exists()  # save_interval 0: no checkpoints


def test_eval_before_training_is_rollout_0_and_redone_only_from_scratch(
        tmp_path, _minisparse_cache, eval_dir):
    """eval_before_training scores the starting weights as rollout 0; a resumed run keeps
    that row and does not score again, a run restarted from scratch replaces it."""
    out = tmp_path / "before"
    args = ["--set", "eval_before_training=true", "--set", "save_interval=1",
            *_eval_args(eval_dir)]
    res = _train(out, "--set", "num_rollout=1", *args, cache=_minisparse_cache)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "before training: gsm8k " in res.stdout
    rows = _rows(out)
    assert [r["rollout"] for r in rows] == [0, 1]
    assert "eval/gsm8k/accuracy" in rows[0] and "train/pg_loss" not in rows[0]
    assert (out / "eval" / "rollout_000000" / "gsm8k" / "samples.jsonl").is_file()
    res = _train(out, "--set", "num_rollout=2", *args, "--resume", cache=_minisparse_cache)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "before training" not in res.stdout
    assert [r["rollout"] for r in _rows(out)] == [0, 1, 2]


@pytest.mark.parametrize("compress", [False, True])
def test_in_training_eval_is_dense_unless_asked(tmp_path, _minisparse_cache, compress):
    """tiny_rkv's prompts pass its budget at once, so a compressed evaluation compresses
    every sample; eval.compress false (the default) scores with a dense cache, as a dense
    run is scored. The held-out arithmetic follows the run's data.synthetic_* keys."""
    out = tmp_path / "eval"
    keys = ["num_rollout=1", "save_interval=0", "eval_interval=1", "eval.benchmarks=arithmetic",
            "eval.limit=2", "eval.max_new_tokens=12", "eval.n_samples=1",
            f"eval.compress={str(compress).lower()}", "data.synthetic_max_operand=9",
            "data.synthetic_operators=+"]
    res = _train(out, *[a for k in keys for a in ("--set", k)], cache=_minisparse_cache)
    assert res.returncode == 0, res.stderr[-3000:]
    bench = out / "eval" / "rollout_000001" / "arithmetic"
    metrics = json.loads((bench / "metrics.json").read_text())["metrics"]
    assert (metrics["mean_compressions"] > 0) == compress
    questions = [json.loads(line)["question"] for line in (bench / "samples.jsonl").open()]
    assert all(q.startswith("What is $") and " + " in q for q in questions)
    assert all(int(n) <= 9 for q in questions for n in q[9:-2].split(" + "))


def test_sigterm_stops_with_the_last_update_saved_and_the_command_resumes(
        tmp_path, _minisparse_cache):
    """A SIGTERM (a time limit's, a scheduler's) ends the run within seconds with a
    checkpoint of the last completed update, though save_interval would not save until
    rollout 50: the same command then resumes after it instead of starting over. (A stop
    in each phase: tests/train/test_train_stop.py.)"""
    out = tmp_path / "stopped"
    args = ["--set", "num_rollout=50", "--set", "save_interval=50"]
    res = _signalled_after(out, 1, signal.SIGTERM, *args, cache=_minisparse_cache)
    stdout, stderr = res.stdout, res.stderr
    assert res.returncode == 0, stderr[-3000:]
    done = len(_rows(out))
    assert done == 1  # the signal came as rollout 1's row was written
    assert re.search(rf"\nstopped by SIGTERM (after rollout {done}|in rollout {done + 1}) of 50 "
                     rf".*; saved: {re.escape(str(out))}/checkpoints/rollout_{done:06d} "
                     rf"\(rollout {done}\); to continue from it: python train.py ", stdout)
    assert [p.name for p in complete_checkpoints(out)] == [f"rollout_{done:06d}"]
    again = _train(out, "--set", f"num_rollout={done + 1}", "--set", "save_interval=50",
                   cache=_minisparse_cache)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"(rollout {done}," in again.stdout
    assert [r["rollout"] for r in _rows(out)] == list(range(1, done + 2))


def _started(out: Path, *args: str, cache: Path, **env: str) -> subprocess.Popen:
    """A run, returned once its pre-flight has taken output_dir's lock: in set-up, before
    its model loads."""
    proc = subprocess.Popen(_cmd(out, *args), cwd=REPO, env=_env(cache, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock, deadline = out / ".run.lock", time.monotonic() + 300
    while not (lock.is_file() and f'"pid": {proc.pid},' in lock.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    return proc


@pytest.mark.parametrize("signum, code, name", [(signal.SIGINT, 130, "Ctrl-C"),
                                                (signal.SIGTERM, 143, "SIGTERM")])
def test_a_signal_during_set_up_stops_at_once_in_one_line(tmp_path, _minisparse_cache,
                                                          signum, code, name):
    """Set-up (a big model's loading: half an hour) ignored SIGTERM until the first
    rollout ended, and Ctrl-C printed a traceback. Now either stops it within seconds,
    saying so in one line with the command that starts it again."""
    out = tmp_path / "setup"
    proc = _started(out, cache=_minisparse_cache)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=300)  # a hang's bound, not a speed target
    assert proc.returncode == code, stderr[-3000:]
    assert "Traceback" not in stderr + stdout
    assert stdout.endswith(f"stopped by {name} during set-up; nothing saved yet; to start "
                           f"again: python train.py {' '.join(BASE)} --set output_dir={out}\n")
    assert not (out / "metrics.jsonl").exists()


# Python's -X importtime line for a torch module: train.py is importing the libraries
TORCH_IMPORTED = re.compile(rb"\| +torch[.\n]")


def _stderr_until(proc: subprocess.Popen, pattern: re.Pattern, timeout: float) -> bytes:
    """What proc wrote to stderr up to the first match of pattern (all of it if stderr
    closes first), read from the pipe itself so that communicate() gets the rest."""
    seen, deadline = b"", time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stderr, selectors.EVENT_READ)
        while not pattern.search(seen):
            assert selector.select(deadline - time.monotonic()), seen[-3000:]
            chunk = os.read(proc.stderr.fileno(), 65536)
            if not chunk:
                break
            seen += chunk
    return seen


def test_ctrl_c_while_the_libraries_import_exits_130_without_a_traceback(tmp_path,
                                                                         _minisparse_cache):
    """The first seconds go to importing torch, transformers and DeepSpeed; a Ctrl-C then
    printed a KeyboardInterrupt traceback. The Ctrl-C comes as the run says (Python's own
    import-time lines) that torch is importing, however slow the machine."""
    proc = subprocess.Popen(_cmd(tmp_path / "out"), cwd=REPO,
                            env=_env(_minisparse_cache, PYTHONPROFILEIMPORTTIME="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    before = _stderr_until(proc, TORCH_IMPORTED, timeout=300)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert TORCH_IMPORTED.search(before), before[-3000:]  # it was importing
    assert proc.returncode == 130
    assert stderr == "stopped by Ctrl-C while starting; nothing saved yet\n", stderr[-3000:]


def test_ctrl_c_in_training_names_the_checkpoint_and_the_command_that_resumes(
        tmp_path, _minisparse_cache):
    """Ctrl-C stops within seconds, without a traceback, exit 130: one line names the
    newest checkpoint and the command; that command, run again, resumes after it."""
    out = tmp_path / "ctrl_c"
    args = ["--set", "num_rollout=12", "--set", "save_interval=1"]
    res = _signalled_after(out, 2, signal.SIGINT, *args, cache=_minisparse_cache)
    stdout, stderr = res.stdout, res.stderr
    assert res.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr + stdout
    newest = latest_checkpoint(out)
    done = int(newest.name.split("_")[1])
    match = re.search(rf"\nstopped by Ctrl-C (after rollout|in rollout) (\d+) of 12 .*; saved: "
                      rf"{re.escape(str(newest))} \(rollout {done}\); to continue from it: "
                      rf"(python train.py .*)\n$", stdout)
    assert match, stdout[-2000:]
    assert int(match[2]) == (done if match[1] == "after rollout" else done + 1)
    command = shlex.split(match[3])
    assert command[1:] == _cmd(out, *args)[1:]
    again = subprocess.run([sys.executable, *command[1:], "--resume"], cwd=REPO,
                           env=_env(_minisparse_cache), capture_output=True, text=True,
                           timeout=600, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {newest} (rollout {done}," in again.stdout
    assert [r["rollout"] for r in _rows(out)] == list(range(1, 13))


def test_two_ranks_gloo(tmp_path, _minisparse_cache, eval_dir):
    """Two ranks train and split the evaluation (2 + 1 problems); rank 0 writes the
    gathered samples in problem order (tests/evaluation/test_loop.py checks that the split
    scores equal one process's)."""
    out = tmp_path / "ddp"
    env = _env(_minisparse_cache)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_ports()),
        "train.py",
        *BASE,
        "--set",
        "num_rollout=1",
        "--set",
        f"output_dir={out}",
        *_eval_args(eval_dir),
    ]
    res = subprocess.run(
        cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(out)
    assert len(rows) == 1  # rank 0 alone writes
    # 4 prompts x 4 samples, 2 prompts per rank; the random tiny model earns no reward, so
    # all 4 groups carry no signal: counted per rank and summed (a mean would give 2)
    assert rows[0]["advantage/zero_signal_groups"] == 4.0
    ckpt = out / "checkpoints" / "rollout_000001"
    assert (ckpt / "COMPLETE").is_file()
    assert (ckpt / "rng_rank0.pt").is_file() and (ckpt / "rng_rank1.pt").is_file()
    samples = (out / "eval" / "rollout_000001" / "gsm8k" / "samples.jsonl").read_text()
    records = [json.loads(line) for line in samples.splitlines()]
    assert [(r["problem_index"], r["sample_index"]) for r in records] == [
        (p, s) for p in range(3) for s in range(2)
    ]
    metrics = json.loads((out / "eval" / "rollout_000001" / "gsm8k" / "metrics.json").read_text())
    assert metrics["metrics"]["ranks"] == 2
    assert rows[0]["eval/gsm8k/mean_response_tokens"] == metrics["metrics"]["mean_response_tokens"]


UNUSABLE_ROWS = ('{"prompt": "What is 1 + 1?", "label": "2"}\n'
                 '{"prompt": "Which of these is prime?", "label": ""}\n'
                 '{"prompt": "What is 2 + 3?", "label": "5"}\n'
                 '{"prompt": "What is 4 - 1?", "label": "3"}\n'
                 '{"prompt": "What is 2 * 3?", "label": "6"}\n')


def test_rows_without_a_label_are_left_out_in_one_line_and_recorded(tmp_path,
                                                                     _minisparse_cache):
    """The paper's file has such rows, and a run refused it whole; now the run says so
    first, trains on the rest and records the count with its metrics."""
    data, out = tmp_path / "d.jsonl", tmp_path / "run"
    data.write_text(UNUSABLE_ROWS)
    res = _train(out, "--set", f"data.path={data}", "--set", "num_rollout=1", "--set",
                 "save_interval=0", "--set", "log.tensorboard=false", cache=_minisparse_cache)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.splitlines()[0] == (
        f"data: 1 of 5 rows left out (cannot be trained on): 1 without a label (first: "
        f"{data}:2); data.strict=true stops at such a row instead")
    (row,) = _rows(out)
    assert (row["data/rows"], row["data/rows_left_out"]) == (5.0, 1.0)


def test_a_data_error_is_said_once_under_torchrun(tmp_path, _minisparse_cache):
    """Every rank checks the same file: the line came once per process. Rank 0 says it;
    every rank exits 2 (torchrun then reports the failure itself, exit 1), unless torchrun,
    seeing one rank fail first, stops the other with SIGTERM before it gets there."""
    data = tmp_path / "d.jsonl"
    data.write_text(UNUSABLE_ROWS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_ports()), "train.py", *BASE, "--set", f"data.path={data}",
           "--set", "data.strict=true", "--set", f"output_dir={tmp_path / 'out'}"]
    res = subprocess.run(cmd, check=False, cwd=REPO, env=_env(_minisparse_cache),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {data}:2: label is empty ('')"], res.stderr[-3000:]
    codes = re.findall(r"exitcode  : (-?\d+)", res.stderr)  # each rank, as torchrun reports it
    assert len(codes) == 2 and "2" in codes and set(codes) <= {"2", "-15"}, res.stderr[-3000:]
    assert res.stdout == ""


REFUSES_FP16 = """
import runpy, sys
import deepspeed.accelerator.cpu_accelerator as cpu
cpu.CPU_Accelerator.is_fp16_supported = lambda self: False  # as on an AMD EPYC
sys.argv, sys.path[0] = sys.argv[1:], "."  # as `python train.py ...` in the repo
runpy.run_path("train.py", run_name="__main__")
"""


def test_float16_on_a_cpu_deepspeed_refuses_it_is_one_line(tmp_path, _minisparse_cache):
    """DeepSpeed's CPU accelerator takes float16 only with AVX512-FP16 or AMX (this test
    makes it say no, as it does on an AMD EPYC): deepspeed.initialize's traceback became
    the pre-flight's line."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("with a GPU DeepSpeed's accelerator is CUDA's, not the CPU's")
    wrapper = tmp_path / "no_fp16.py"
    wrapper.write_text(REFUSES_FP16)
    cmd = _cmd(tmp_path / "out", "--set", "model.dtype=float16", "--set", "zero_stage=3")
    res = subprocess.run([sys.executable, str(wrapper), *cmd[1:]], cwd=REPO,
                         env=_env(_minisparse_cache), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2
    assert res.stderr == (
        "error: model.dtype=float16: DeepSpeed's cpu accelerator does not train in float16 on "
        "this machine (its CPU has no AVX512-FP16 or AMX); use --set model.dtype=bfloat16 or "
        "--set model.dtype=float32\n")


def test_a_stale_extension_lock_does_not_hang_the_run(tmp_path, _minisparse_cache):
    """A run killed while DeepSpeed JIT-built its CPU shared-memory op left torch's lock
    behind, and every later run waited for it forever in deepspeed.initialize. That op is
    never built now: a run finishes with the lock in place (bounded: a regression fails
    at the timeout instead of hanging the suite)."""
    extensions = tmp_path / "torch_extensions"
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    out = tmp_path / "locked"
    res = _train(out, "--set", "num_rollout=1", "--set", "save_interval=0",
                 cache=_minisparse_cache, timeout=300, TORCH_EXTENSIONS_DIR=str(extensions))
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["rollout"] for r in _rows(out)] == [1]
    assert sorted(p.name for p in lock.parent.iterdir()) == ["lock"]  # nothing built


def test_two_single_process_runs_at_once_both_finish(tmp_path, _minisparse_cache):
    """Without torchrun (no MASTER_PORT) a run needs no TCP port; two at once on one machine
    used to collide on port 29500 (EADDRINUSE)."""
    outs = [tmp_path / "a", tmp_path / "b"]
    procs = [subprocess.Popen(_cmd(out, "--set", "num_rollout=1", "--set", "save_interval=0"),
                              cwd=REPO, env=_env(_minisparse_cache), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for out in outs]
    try:
        errors = [proc.communicate(timeout=600)[1] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0], [e[-2000:] for e in errors]
    assert [[r["rollout"] for r in _rows(out)] for out in outs] == [[1], [1]]


def test_a_second_run_in_the_same_folder_exits_2_naming_the_first(tmp_path, _minisparse_cache):
    """Two runs in one output_dir destroyed each other (the second's save deleted the first's
    checkpoint in progress as stale, metrics.jsonl interleaved). The second now stops before
    its model loads, naming the first, which goes on untouched to a SIGTERM stop. The first
    took over the record a killed run had left, saying so; its own clean exit clears it."""
    out, lock = tmp_path / "shared", tmp_path / "shared" / ".run.lock"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                "started": time.time() - 60, "process_start": None}))
    # more rollouts than it can train while the second starts and stops, however busy
    # the machine: a SIGTERM ends it
    args = ["--set", "num_rollout=1000", "--set", "save_interval=1"]
    first = subprocess.Popen(_cmd(out, *args), cwd=REPO, env=_env(_minisparse_cache),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while f'"pid": {first.pid},' not in lock.read_text():
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        second = _train(out, *args, cache=_minisparse_cache, timeout=120)
        metrics = out / "metrics.jsonl"
        while not metrics.is_file() or "\n" not in metrics.read_text():  # set-up is over
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        assert first.poll() is None  # still training
        first.send_signal(signal.SIGTERM)  # in training: the last update saved, stopped
        stdout, stderr = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 2 and second.stdout == "", second.stderr[-3000:]
    host, when = re.escape(socket.gethostname()), r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    assert re.fullmatch(rf"error: {re.escape(str(out))} is in use by another run \(pid "
                        rf"{first.pid} on host {host}, started {when}\); wait for it or "
                        rf"choose another output_dir\n", second.stderr), second.stderr
    assert first.returncode == 0, stderr[-3000:]
    assert re.match(rf"{re.escape(str(out))}: taking it over from a run that ended without "
                    rf"releasing it \(pid {dead.pid} on host {host}, started {when}\)\n", stdout)
    done = list(range(1, len(_rows(out)) + 1))
    assert done and [r["rollout"] for r in _rows(out)] == done
    assert [p.name for p in complete_checkpoints(out)] == [f"rollout_{r:06d}" for r in done]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        f"rollout_{r:06d}" for r in done]  # no .tmp_ or .del_ left behind
    assert lock.read_text() == ""


def test_greedy_training_is_a_config_error(tmp_path, _minisparse_cache):
    res = _train(tmp_path / "g", "--set", "temperature=0", cache=_minisparse_cache)
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1
    assert res.stderr.startswith("error: config key 'temperature' is 0 (greedy): the "
                                 "n_samples_per_prompt samples of a prompt would all be the same")


def test_gspo_with_a_reward_plugin_and_dynamic_sampling(tmp_path, _minisparse_cache):
    """The three ablation switches together in one tiny run: the plug-in rewards odd-length
    responses (the random model earns no math reward, so groups would have no signal),
    gspo with geometric weights, and dynamic sampling capped at 3 rounds of 4 prompts."""
    (tmp_path / "parity_reward.py").write_text(
        "def parity(response, label, metadata):\n    return float(len(response) % 2)\n")
    out = tmp_path / "run"
    res = _train(out, "--set", "num_rollout=1", "--set", "save_interval=0",
                 "--set", "reward.function=parity_reward:parity", "--set", "loss.advantage=gspo",
                 "--set", "loss.tis_level=geometric", "--set", "dynamic_sampling=true",
                 "--set", "dynamic_sampling_max_rounds=3", cache=_minisparse_cache,
                 PYTHONPATH=str(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = _rows(out)
    rounds = row["dynamic_sampling/rounds"]
    assert 1 <= rounds <= 3 and row["dynamic_sampling/drawn_groups"] == 4 * rounds
    # the only zero-signal groups left in the batch are the filler put back at the cap
    assert row["advantage/zero_signal_groups"] == row["dynamic_sampling/filled_groups"]
    assert (row["dynamic_sampling/zero_signal_groups"] + 4
            == row["dynamic_sampling/drawn_groups"] - row["dynamic_sampling/surplus_groups"]
            + row["dynamic_sampling/filled_groups"])


def test_no_config_lists_the_shipped_configs_and_exit_2():
    """`python train.py` alone starts nothing (the built-in defaults are an hour-long GPU
    shape), and says what to run instead."""
    res = subprocess.run([sys.executable, "train.py"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("train.py: error: no --config given")
    for name in ("tiny_rkv", "smollm2_cpu", "qwen3b_rkv"):
        assert f"\n  {name} " in res.stderr


def test_compression_that_never_runs_is_a_config_error(tmp_path, _minisparse_cache):
    res = _train(tmp_path / "c", "--set", "compress.budget=400", cache=_minisparse_cache)
    assert res.returncode == 2
    assert res.stderr.startswith("error: compression never runs: with "
                                 "compress.budget 400 and compress.divide_length 8")


def test_verbose_shows_the_libraries_output(tmp_path, _minisparse_cache):
    """Hidden by default (tests/test_quickstart.py), there with log.verbose."""
    res = _train(tmp_path / "v", "--set", "num_rollout=1", "--set", "log.verbose=true",
                 cache=_minisparse_cache)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "built successfully" in res.stdout or "Writing model shards" in res.stderr


def test_the_console_line_columns_are_explained_once_at_start():
    """train.py names its console line's columns; the start report's last two lines explain
    them in plain words."""
    import train
    from minisparse.trainer.logger import summary_legend

    first, second = summary_legend(train.COLUMNS).splitlines()
    assert first.startswith("each rollout's line: reward = mean reward, acc = share "
                            "answered right, len = mean answer tokens")
    assert "keep = share of tokens kept by rejection sampling" in second
    assert second.endswith("; time = seconds per phase")
