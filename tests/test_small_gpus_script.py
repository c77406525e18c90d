"""scripts/gpu_small_gpus.sh on the CPU: the tiny model planned for a capped GPU with the
optimizer on the CPU, and the script's planned-against-measured table."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minisparse.trainer.train_engine import cpu_adam_missing
from scripts.ports import free_ports

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_small_gpus.sh"


def test_help_names_its_settings():
    res = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True)
    assert res.returncode == 0
    for name in ("CAP", "CONFIG", "MODEL", "RUNS", "ROLLOUTS", "LIMIT_S", "ROOT", "HOST_GB"):
        assert name in res.stdout


def test_tiny_run_prints_the_plan_and_the_table(tmp_path):
    if cpu_adam_missing():
        pytest.skip(f"DeepSpeed's CPU Adam op cannot build here: needs {cpu_adam_missing()}")
    env = {**os.environ, "CAP": "1", "CONFIG": "tiny_rkv", "MODEL": "tiny", "DATA": "synthetic",
           "LEN": "64", "PROMPTS": "2", "ROLLOUTS": "1", "RUNS": "sparse", "ROOT": str(tmp_path),
           "EXTRA": "--set optimizer_offload=cpu_adam", "PORT": str(free_ports(2)),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    res = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = res.stdout
    assert "=== capped at 1 GiB: planned against measured" in out
    (head,) = [line for line in out.splitlines() if line.startswith("--- sparse: memory plan:")]
    assert "gpu_memory_gb=1" in head and "DeepSpeed CPU Adam, optimizer_offload=cpu_adam" in head
    row = out.split("(rollout, logprobs, update)\n", 1)[1].splitlines()[0].split()
    assert row[0] == "1" and float(row[1]) > 0  # rollout 1, its step time
