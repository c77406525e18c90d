"""scripts/dense_vs_sparse.sh on the CPU: the tiny model's compressed and dense runs one
after the other, their phase tables and the step-time ratio read from both metrics."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "dense_vs_sparse.sh"


def _tiny_env(root: Path) -> dict[str, str]:
    """The script on the tiny model: a compressed and a dense run of seconds each."""
    return {**os.environ, "CONFIG": "tiny_rkv", "MODEL": "tiny", "DATA": "synthetic",
            "LEN": "64", "PROMPTS": "2", "ROLLOUTS": "1", "ROOT": str(root),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def test_help_names_its_settings():
    res = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True)
    assert res.returncode == 0
    for name in ("CONFIG", "MODEL", "DATA", "LEN", "PROMPTS", "ROLLOUTS", "ROOT", "LIMIT_S",
                 "RUNS", "AT_ONCE"):
        assert name in res.stdout


def test_tiny_pair_prints_both_runs_and_the_ratio(tmp_path):
    env = _tiny_env(tmp_path)
    res = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = res.stdout
    assert "sparse: exit 0" in out and "dense: exit 0" in out
    assert "=== sparse" in out and "=== dense" in out and "--- rollout 1" in out
    ratio = [line for line in out.splitlines() if "dense / compressed" in line]
    assert len(ratio) == 1 and ratio[0].startswith("rollout 1: step dense ")
    for name in ("sparse", "dense"):
        assert (tmp_path / name / "metrics.jsonl").read_text().count("\n") == 1
    dense_log = (tmp_path / "dense.log").read_text()
    assert "dense (no compression)" in dense_log and "R-KV" in (tmp_path / "sparse.log").read_text()


def test_pair_split_over_two_commands(tmp_path):
    """RUNS=sparse now and RUNS=dense later (two jobs under a time limit): the first
    prints no ratio and succeeds, the second reads the first's metrics for the ratio; a
    dense run of more rollouts gets none."""
    env = _tiny_env(tmp_path)
    first = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env={**env, "RUNS": "sparse"},
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "sparse: exit 0" in first.stdout and "dense: exit" not in first.stdout
    assert "not run yet (RUNS=dense" in first.stdout
    assert "no step-time ratio yet: RUNS=dense" in first.stdout
    second = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env={**env, "RUNS": "dense"},
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert "sparse: exit" not in second.stdout and "dense: exit 0" in second.stdout
    assert second.stdout.count("--- rollout 1") == 2
    assert "dense / compressed" in second.stdout
    third = subprocess.run(["bash", str(SCRIPT)], cwd=REPO,
                           env={**env, "RUNS": "dense", "ROLLOUTS": "2"},
                           capture_output=True, text=True, timeout=300)
    assert third.returncode == 1 and "dense / compressed" not in third.stdout
    assert "last rollouts differ (compressed 1, dense 2)" in third.stderr


def test_bad_settings_exit_2_naming_them(tmp_path):
    env = {**os.environ, "RUNS": "sparse h2o", "ROOT": str(tmp_path)}
    res = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "RUNS: 'h2o' is not sparse or dense" in res.stderr
    env = {**os.environ, "AT_ONCE": "yes", "ROOT": str(tmp_path)}
    res = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "AT_ONCE: 'yes' is not 0 or 1" in res.stderr
