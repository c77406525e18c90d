"""scripts/dense_vs_sparse.sh on the CPU: the tiny model's compressed and dense runs one
after the other, their phase tables and the step-time ratio read from both metrics; and
scripts/pair_table.py, which reads that ratio, over repeated pairs."""
import json
import os
import subprocess
import sys
from pathlib import Path

from run_helpers import port_in_use
from scripts.ports import free_ports

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "dense_vs_sparse.sh"
PAIR_TABLE = [sys.executable, "-m", "scripts.pair_table"]


def _tiny_env(root: Path) -> dict[str, str]:
    """The script on the tiny model: a compressed and a dense run of seconds each."""
    return {**os.environ, "CONFIG": "tiny_rkv", "MODEL": "tiny", "DATA": "synthetic",
            "LEN": "64", "PROMPTS": "2", "ROLLOUTS": "1", "ROOT": str(root),
            "PORT": str(free_ports(2)),  # not the default: another pair may hold it
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
    assert len(ratio) == 1 and ratio[0].startswith(f"{tmp_path.name}: rollout 1: step dense ")
    for name in ("sparse", "dense"):
        assert (tmp_path / name / "metrics.jsonl").read_text().count("\n") == 1
    dense_log = (tmp_path / "dense.log").read_text()
    assert "dense (no compression)" in dense_log and "R-KV" in (tmp_path / "sparse.log").read_text()


def test_pair_split_over_two_commands(tmp_path):
    """RUNS=sparse now and RUNS=dense later (two jobs under a time limit): the first
    prints no ratio and succeeds, the second reads the first's metrics for the ratio; a
    dense run of more rollouts gets none; RUNS="" only reads what ROOT holds."""
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
    runs = {name: (tmp_path / name / "metrics.jsonl").read_text() for name in ("sparse", "dense")}
    tables = subprocess.run(["bash", str(SCRIPT)], cwd=REPO,
                            env={**env, "RUNS": "", "ROLLOUTS": "2"},
                            capture_output=True, text=True, timeout=300)
    assert tables.returncode == 1 and "exit" not in tables.stdout  # RUNS="": nothing started
    assert "last rollouts differ (compressed 1, dense 2)" in tables.stderr
    assert {name: (tmp_path / name / "metrics.jsonl").read_text() for name in runs} == runs


def test_bad_settings_exit_2_naming_them(tmp_path):
    env = {**os.environ, "RUNS": "sparse h2o", "ROOT": str(tmp_path)}
    res = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "RUNS: 'h2o' is not sparse or dense" in res.stderr
    env = {**os.environ, "AT_ONCE": "yes", "ROOT": str(tmp_path)}
    res = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "AT_ONCE: 'yes' is not 0 or 1" in res.stderr
    with port_in_use() as port:  # another pair's run listening on the dense run's port
        env = {**os.environ, "RUNS": "dense", "PORT": str(port - 1), "ROOT": str(tmp_path)}
        res = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=60)
    assert res.returncode == 2
    assert f"PORT: {port} (the dense run's) is in use, by another pair perhaps" in res.stderr
    assert not (tmp_path / "dense.log").exists()


def _write_pair(root: Path, sparse_step: float, dense_step: float, rollout: int = 3) -> None:
    """A pair's two run folders holding rollouts 2..rollout (step and rollout phase times)."""
    for name, step in (("sparse", sparse_step), ("dense", dense_step)):
        rows = [{"rollout": r, "time/step_s": step + r - rollout, "time/rollout_s": step / 2,
                 "perf/peak_kv_tokens": 1000.0 if name == "dense" else 400.0}
                for r in range(2, rollout + 1)]
        (root / name).mkdir(parents=True)
        (root / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_pair_table_medians_over_repeated_pairs(tmp_path):
    """Three repeats of a pair: each pair's ratio at the last rollout, the median row of
    each run and the median ratio with its range; --rollout picks an earlier rollout."""
    for label, sparse, dense in (("a", 20.0, 30.0), ("b", 25.0, 25.0), ("c", 40.0, 44.0)):
        _write_pair(tmp_path / label, sparse, dense)
    roots = [str(tmp_path / label) for label in "abc"]
    res = subprocess.run([*PAIR_TABLE, *roots], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "| a | compressed | 20.0 | 10.0 | - | - | - | 400 | - |" in lines
    assert "| median of 3 | compressed | 25.0 | 12.5 | - | - | - | 400 | - |" in lines
    assert "| median of 3 | dense | 30.0 | 15.0 | - | - | - | 1,000 | - |" in lines
    assert ("a: rollout 3: step dense 30.0 s, compressed 20.0 s: dense / compressed 1.50x "
            "(rollout 1.50x)") in lines
    assert lines[-1] == ("median of 3 pairs: dense / compressed 1.10x a step (1.00-1.50x), "
                         "1.10x a rollout (1.00-1.50x)")
    earlier = subprocess.run([*PAIR_TABLE, roots[0], "--rollout", "2"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert "a: rollout 2: step dense 29.0 s, compressed 19.0 s: dense / compressed 1.53x" \
        in earlier.stdout
    missing = subprocess.run([*PAIR_TABLE, roots[0], "--rollout", "5"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1
    assert "no step-time ratio: sparse and dense did not finish rollout 5" in missing.stderr
    elsewhere = subprocess.run([*PAIR_TABLE, str(tmp_path)], cwd=REPO,
                               capture_output=True, text=True, timeout=60)
    assert elsewhere.returncode == 2
    assert elsewhere.stderr == (f"{tmp_path}: not a pair's folder (it holds no sparse/ or "
                                "dense/ run)\n")


def test_pair_table_medians_over_a_span_of_rollouts(tmp_path):
    """--rollouts A-B: each column's median over those rollouts of each run, and the ratio
    of the medians; a span a run did not finish is refused, naming it."""
    _write_pair(tmp_path / "p", 20.0, 30.0, rollout=5)  # steps 17-20 and 27-30 s
    root = str(tmp_path / "p")
    res = subprocess.run([*PAIR_TABLE, root, "--rollouts", "2-4"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "| p | compressed | 18.0 | 10.0 | - | - | - | 400 | - |" in res.stdout.splitlines()
    assert res.stdout.splitlines()[-1] == (
        "p: rollouts 2-4 (medians): step dense 28.0 s, compressed 18.0 s: dense / compressed "
        "1.56x (rollout 1.50x)")
    short = subprocess.run([*PAIR_TABLE, root, "--rollouts", "2-6"], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert short.returncode == 1
    assert "sparse and dense did not finish rollouts 2-6" in short.stderr
    bad = subprocess.run([*PAIR_TABLE, root, "--rollouts", "4-2"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "FIRST-LAST" in bad.stderr


def test_from_three_rollouts_the_script_also_prints_the_medians_from_rollout_2(tmp_path):
    _write_pair(tmp_path, 20.0, 30.0, rollout=4)  # rollouts 2-4 of both runs, read only
    env = {**_tiny_env(tmp_path), "RUNS": "", "ROLLOUTS": "4"}
    res = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    ratios = [line for line in res.stdout.splitlines() if "dense / compressed" in line]
    assert ratios == [
        f"{tmp_path.name}: rollout 4: step dense 30.0 s, compressed 20.0 s: dense / "
        "compressed 1.50x (rollout 1.50x)",
        f"{tmp_path.name}: rollouts 2-4 (medians): step dense 29.0 s, compressed 19.0 s: "
        "dense / compressed 1.53x (rollout 1.50x)"]
