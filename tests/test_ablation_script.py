"""scripts/ablation.sh without a GPU: its options, the runs it would start
(--dry-run) and the errors it gives; the runs themselves are train.py's (tests/train/test_train.py)."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from run_helpers import port_in_use
from scripts.ports import free_ports

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "ablation.sh"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", **env})


def test_help_names_every_option():
    res = _run("--help")
    assert res.returncode == 0
    for option in ("--seeds", "--variants", "--rollouts", "--eval-every", "--train-s",
                   "--grace-s", "--root", "--kv-gb", "--micro-tokens", "--pack", "--records",
                   "--port", "--dry-run"):
        assert option in res.stdout


def test_dry_run_starts_every_seed_of_every_variant_on_its_own_port(tmp_path):
    res = _run("--dry-run", "--seeds", "1,2", "--variants", "dense rkv_naive rkv_keep_prompt",
               "--rollouts", "30", "--eval-every", "5", "--root", str(tmp_path))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 6
    ports = [line.split()[1] for line in lines]
    assert ports == [f"MASTER_PORT={29600 + i}" for i in range(6)]
    names = [line.split("output_dir=")[1].split()[0] for line in lines]
    assert names == [f"{tmp_path}/{v}_seed{s}" for s in (1, 2)
                     for v in ("dense", "rkv_naive", "rkv_keep_prompt")]
    for line in lines:
        assert "--set num_rollout=30 --set eval_interval=5 --set save_interval=5" in line
        assert "--set engine.kv_memory_gb=1 --set max_tokens_per_gpu=2048 " in line
    assert "--config smollm2_dense" in lines[0] and "seed=1" in lines[0]
    assert "--config smollm2_rkv --set loss.use_tis=false" in lines[1]
    assert "--config smollm2_rkv --set compress.keep_prompt=true" in lines[2]
    assert "seed=2" in lines[5]


def test_the_papers_length_on_the_real_model_is_one_command(tmp_path):
    """The 100-rollout ablation of docs/results.md: dense, naive R-KV, R-KV and SnapKV of
    the coder1.5b family at seed 1, MATH500 every 20 rollouts, saved as often, so the
    same command resumes it stretch after stretch."""
    res = _run("--dry-run", "--family", "coder1.5b", "--seeds", "1", "--variants",
               "dense rkv_naive rkv snapkv", "--rollouts", "100", "--eval-every", "20",
               "--kv-gb", "0", "--micro-tokens", "16384", "--train-s", "480",
               "--records", str(tmp_path / "records"), "--root", str(tmp_path))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    configs = [line.split("--config ")[1].split()[0] for line in lines]
    assert configs == ["coder1.5b_dense", "coder1.5b_rkv", "coder1.5b_rkv", "coder1.5b_snapkv"]
    assert "--set loss.use_tis=false" in lines[1] and "use_tis" not in lines[2]
    for line in lines:
        assert "--set seed=1 --set num_rollout=100 --set eval_interval=20" in line
        assert "--set save_interval=20 " in line and "kv_memory_gb" not in line
        assert "--set max_tokens_per_gpu=16384 " in line
    assert not (tmp_path / "records").exists()  # a dry run writes nothing


def test_environment_sets_what_flags_set(tmp_path):
    res = _run("--dry-run", "--root", str(tmp_path), SEEDS="7", VARIANTS="snapkv",
               MICRO_TOKENS="4096", EXTRA="--set optim.lr=2e-5")
    assert res.returncode == 0, res.stderr
    [line] = res.stdout.splitlines()
    assert "--config smollm2_snapkv" in line and "seed=7" in line
    assert "--set max_tokens_per_gpu=4096 " in line
    assert line.endswith("--set optim.lr=2e-5")


def test_bad_options_exit_2_naming_them(tmp_path):
    res = _run("--dry-run", "--variants", "dense h2o", "--root", str(tmp_path))
    assert res.returncode == 2 and "unknown variant 'h2o'" in res.stderr
    res = _run("--dry-run", "--rollouts", "ten", "--root", str(tmp_path))
    assert res.returncode == 2 and "'ten' is not a whole number" in res.stderr
    res = _run("--dry-run", "--micro-tokens", "2k", "--root", str(tmp_path))
    assert res.returncode == 2 and "'2k' is not a whole number" in res.stderr
    res = _run("--seed", "1")
    assert res.returncode == 2 and "unknown option --seed" in res.stderr


def test_a_port_taken_is_named_before_any_run(tmp_path):
    with port_in_use() as port:  # another run listening on the second run's port
        res = _run("--seeds", "1", "--variants", "dense rkv", "--port", str(port - 1),
                   "--root", str(tmp_path / "abl"), BASE=str(tmp_path),
                   PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin")
    assert res.returncode == 2
    assert f"ablation.sh: port {port} is in use, by another run perhaps" in res.stderr
    assert not (tmp_path / "abl").exists()


def test_runs_score_themselves_and_a_second_command_skips_the_finished(tmp_path, tiny_path):
    """Two tiny runs side by side (the SmolLM2 configs made small), evaluated every
    rollout; the tables come from their metrics, the pack holds them; the same command
    again starts nothing."""
    small = ["model.dtype=float32", "max_response_len=24", "eval.max_new_tokens=24",
             "eval.limit=2", "rollout_batch_size=2", "n_samples_per_prompt=2",
             "global_batch_size=4", "num_steps_per_rollout=1", "compress.budget=12",
             "compress.divide_length=4", "data.synthetic_size=16", "eval.prompt_template=boxed",
             "data.apply_chat_template=false", "engine.kv_cpu_memory_gb=0.1",
             "log.tensorboard=false"]
    env = {"BASE": str(tiny_path), "EXTRA": " ".join(f"--set {s}" for s in small),
           "PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", str(tmp_path)),
           "MINISPARSE_CACHE": os.environ["MINISPARSE_CACHE"]}
    args = ["--seeds", "1", "--variants", "dense,rkv_keep_prompt", "--rollouts", "2",
            "--eval-every", "1", "--root", str(tmp_path / "abl"), "--pack",
            str(tmp_path / "abl.tgz"), "--records", str(tmp_path / "kept"),
            "--port", str(free_ports(2))]  # not the default: another run may hold it
    res = subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True,
                         text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    for name in ("dense_seed1", "rkv_keep_prompt_seed1"):
        assert f"{name}: exit 0 after rollout 2 of 2" in res.stdout
    assert "| dense | 1 | 0.0 | 0.0 |" in res.stdout  # the tiny model earns nothing
    assert "| rkv_keep_prompt | 1 |" in res.stdout
    assert (tmp_path / "abl" / "ablation.png").is_file()
    assert "over rollouts 1-2" in (tmp_path / "abl" / "results.md").read_text()
    packed = tarfile.open(tmp_path / "abl.tgz").getnames()
    assert any(n.endswith("dense_seed1/metrics.jsonl") for n in packed)
    assert not any("/checkpoints/" in n for n in packed)
    kept = tmp_path / "kept" / "dense_seed1"
    assert (kept / "metrics.jsonl").read_text() == (
        tmp_path / "abl" / "dense_seed1" / "metrics.jsonl").read_text()
    [graded] = (kept / "eval" / "rollout_000002").glob("*/samples.jsonl")
    assert [set(json.loads(line)) for line in graded.read_text().splitlines()] == [
        {"problem_index", "sample_index", "correct"}] * 2  # eval.limit 2, one sample each
    assert not (kept / "checkpoints").exists()
    again = subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True,
                           text=True, timeout=600, env=env)
    assert "dense_seed1: finished (2 rollouts)" in again.stdout
    assert "exit" not in again.stdout


DESIGNS = REPO / "scripts" / "smollm2_designs.sh"


def test_designs_run_at_once_and_report_each_window(tmp_path, tiny_path):
    """Two tiny designs (dense, and the naive R-KV run at a budget below the prompt) side
    by side: the window table says what share of tokens each sampled from a compressed
    cache: 11 of every 12 of the compressed design's (its prompt is over budget, so the
    cache is compressed right after prefill; only the first token, sampled at prefill,
    saw the whole prompt)."""
    small = ["model.dtype=float32", "max_response_len=12", "eval.max_new_tokens=12",
             "eval.limit=2", "rollout_batch_size=2", "n_samples_per_prompt=2",
             "global_batch_size=4", "num_steps_per_rollout=1", "data.synthetic_size=16",
             "eval.prompt_template=boxed", "data.apply_chat_template=false",
             "engine.kv_cpu_memory_gb=0.1", "log.tensorboard=false"]
    designs = tmp_path / "designs.txt"
    designs.write_text("dense dense\n"
                       "b8 rkv_naive --set compress.budget=8 --set compress.window=4 "
                       "--set compress.divide_length=4\n")
    env = {"BASE": str(tiny_path), "EXTRA": " ".join(f"--set {s}" for s in small),
           "DESIGNS_FILE": str(designs), "ROLLOUTS": "2", "ROOT": str(tmp_path / "d"),
           "PORT": str(free_ports(2)),
           "PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", str(tmp_path)),
           "MINISPARSE_CACHE": os.environ["MINISPARSE_CACHE"]}
    res = subprocess.run(["bash", str(DESIGNS)], cwd=REPO, capture_output=True, text=True,
                         timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    table = res.stdout.split("per 10-rollout window")[1]
    assert "| dense | compressed-token share | 0.00 |" in table
    assert "| b8 | response tokens | 12 |" in table
    assert "| b8 | compressed-token share | 0.92 |" in table
    assert "| b8 | mismatch KL (k1) |" in table
    assert (tmp_path / "d" / "designs.md").read_text() in res.stdout
