"""minisparse.launch: torchrun's launch, a failed run reported as one process reports it."""
import os
import subprocess
import sys
from pathlib import Path

from scripts.ports import free_ports

REPO = Path(__file__).resolve().parents[1]
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    return subprocess.run([sys.executable, "-m", "minisparse.launch", "--nproc_per_node", "2",
                           "--master_port", str(free_ports()), *args], cwd=REPO,
                          env={**env, "MINISPARSE_CACHE": str(cache)}, capture_output=True,
                          text=True, timeout=300, check=False)


def test_bad_input_under_torchrun_is_one_line_and_exit_2(tmp_path, _minisparse_cache):
    """torchrun itself would add ~40 lines (its log lines, a traceback, a failure report)
    after the line, and exit 1."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?", "label": "2"}\n{"prompt": "x", "label": ""}\n')
    res = launch("train.py", "--config", "tiny_rkv", "--set", f"data.path={data}", "--set",
                 "data.strict=true", "--set", f"output_dir={tmp_path / 'out'}",
                 cache=_minisparse_cache)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"error: {data}:2: label is empty ('')"]


def test_a_worker_that_says_nothing_is_named_with_its_exit_status(tmp_path, _minisparse_cache):
    script = tmp_path / "fails.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    res = launch(str(script), cache=_minisparse_cache)
    assert res.returncode == 3
    assert res.stderr.strip().splitlines()[-1].startswith("error: rank 1 (pid ")
    assert res.stderr.strip().endswith(") exited with status 3 (its output above says why)")
    assert "Traceback" not in res.stderr
