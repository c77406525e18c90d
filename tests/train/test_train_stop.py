"""A stop signal in each phase of a tiny CPU run keeps the state of the last completed
update, and the same command resumes to the same run as one never stopped."""
import json
import os
import subprocess
import sys
from pathlib import Path

from scripts import soak_resume

REPO = Path(__file__).resolve().parents[2]

# save_interval 5: a stop must save what a periodic save would not have
SETS = ["num_rollout=5", "save_interval=5", "loss.entropy_coef=0.01", "log.tensorboard=false"]


def launch(out: Path, target: str, cache: Path, signal_name: str = "SIGTERM",
           sets: list[str] = SETS) -> subprocess.CompletedProcess:
    """train.py with `signal_name` sent from inside as `target` starts ('reward 3';
    'end': never), soak_resume.py's traced child."""
    marks = out.parent / f"marks_{out.name}_{target.replace(' ', '_')}"
    cmd = [sys.executable, "-m", "scripts.soak_resume", "--child", str(marks), target, "0",
           signal_name, "--", "--config", "tiny_rkv", "--set", f"output_dir={out}",
           *[arg for key in sets for arg in ("--set", key)]]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run(cmd, cwd=REPO, env={**env, "MINISPARSE_CACHE": str(cache)},
                          capture_output=True, text=True, timeout=600, check=False)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_stop_in_each_phase_keeps_the_last_update_and_resumes_the_same(tmp_path,
                                                                         _minisparse_cache):
    """SIGTERM as the rollout, reward and log-prob phases start drops that rollout and saves
    the one before (though save_interval would not); as the update starts, the update
    finishes and is saved. Each launch resumes where the last stopped, and the rows equal
    an uninterrupted run's."""
    reference = tmp_path / "reference"
    done = launch(reference, "end", _minisparse_cache)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "stopped"
    for target, rollout in (("rollout", 2), ("reward", 3), ("logprobs", 4)):
        res = launch(out, f"{target} {rollout}", _minisparse_cache)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "Traceback" not in res.stderr
        last = res.stdout.splitlines()[-1]
        newest = out / "checkpoints" / f"rollout_{rollout - 1:06d}"
        assert last.startswith(f"stopped by SIGTERM in rollout {rollout} of 5 (dropped before "
                               f"its update; a resume redoes it) after "), last
        assert f" min; saved: {newest} (rollout {rollout - 1}); to continue from it: " in last
        assert [r["rollout"] for r in rows(out)] == list(range(1, rollout))
    res = launch(out, "update 4", _minisparse_cache)
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("SIGTERM received: the run stops once the update under way has finished; send it "
            "again to stop at once\n") in res.stdout
    assert "stopped by SIGTERM after rollout 4 of 5 after " in res.stdout
    res = launch(out, "end", _minisparse_cache)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'rollout_000004'} (rollout 4," in res.stdout
    assert [r["rollout"] for r in rows(out)] == [1, 2, 3, 4, 5]
    for got, want in zip(rows(out), rows(reference), strict=True):
        differ = [k for k in want if not k.startswith(soak_resume.VOLATILE) and got[k] != want[k]]
        assert not differ, (got["rollout"], differ)


def test_a_stop_before_the_first_rollout_ends_saves_nothing_and_starts_over(
        tmp_path, _minisparse_cache):
    """Ctrl-C in the first rollout: no update has run, so there is nothing to keep; exit
    130, as a shell reports a Ctrl-C."""
    out = tmp_path / "first"
    res = launch(out, "rollout 1", _minisparse_cache, "SIGINT")
    assert res.returncode == 130, res.stderr[-3000:]
    assert res.stdout.splitlines()[-1].startswith(
        "stopped by Ctrl-C in rollout 1 of 5 (dropped before its update; a resume redoes it) "
        "after "), res.stdout[-1000:]
    assert " min; nothing saved yet; to start again: python train.py --config" in res.stdout
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
