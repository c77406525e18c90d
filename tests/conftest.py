"""Shared fixtures: a session-wide cache dir so nothing is written to the home dir, and
the tiny model (built once per session) that many test modules load."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

# The suite's helper modules (tests/helpers/) import by name from every test folder.
sys.path.insert(0, str(Path(__file__).parent / "helpers"))

# A test run started as a background job (`cmd &`) inherits SIGINT ignored, and an ignored
# signal stays ignored in every process it starts; the tests that press Ctrl-C on a run
# need it delivered as from a terminal (a caught signal is reset to the default in a child).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Runs compared row for row (a resumed run against a straight one) need the same torch
# thread count: float sums depend on it, and a run left to choose (utils/threads.py)
# follows the machine's load at its start. Every run here takes torch's own default.
os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))


@pytest.fixture(scope="session", autouse=True)
def _minisparse_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("minisparse-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINISPARSE_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="session")
def tiny_path(_minisparse_cache: Path) -> Path:
    from minisparse.models.tiny import build_tiny

    return build_tiny()


SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real data directory; tests that need it skip when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not present")
    return SHARED_DATA


@pytest.fixture
def grade_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, float]]:
    """(workers, timeout_s) of every grade_batch call made during the test (grading still
    runs)."""
    import minisparse.data.reward as reward

    seen: list[tuple[int, float]] = []
    real = reward.grade_batch

    def spy(responses, labels, **kwargs):
        seen.append((kwargs["workers"], kwargs["timeout_s"]))
        return real(responses, labels, **kwargs)

    monkeypatch.setattr(reward, "grade_batch", spy)
    return seen


@pytest.fixture(scope="session")
def _session_process_group():
    """Torn down at the end of the session: DeepSpeed keeps the process group it first
    saw, so a group rebuilt per module would leave its engines pointing at a dead one."""
    yield
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def process_group(_session_process_group):
    """A one-process group (nccl on a GPU, gloo without) for tests that build DeepSpeed
    engines, made once a session; the variables it sets leave with the module. Its value
    is the device to train on."""
    import os

    from minisparse.utils.distributed import init_distributed

    saved = dict(os.environ)
    device = init_distributed()
    yield device
    os.environ.clear()
    os.environ.update(saved)
