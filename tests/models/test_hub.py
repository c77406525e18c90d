"""model.path as a hub id, on the tiny model laid out in the HF cache format (blobs,
snapshots linking to them, refs/main) under a temporary HF_HUB_CACHE. The hub is off
(HF_HUB_OFFLINE=1) and its address is a closed local port: nothing here reaches it."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from spawned_ranks import spawned_rank

from minisparse.models import hub
from minisparse.models.hub import HubModelError, is_hub_id
from minisparse.models.loading import check_model_path, load_policy, model_config
from minisparse.models.tiny import build_tiny

REPO = Path(__file__).resolve().parents[2]
MODEL_ID = "tiny-org/tiny-qwen"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}


def cache_model(cache: Path, repo_id: str, source: Path, missing: tuple[str, ...] = ()) -> Path:
    """source's files as huggingface_hub caches a download of repo_id at COMMIT (blobs,
    the snapshot's links to them, refs/main, the commit's file listing); the snapshot
    folder. `missing` files are listed but not there: a download cut short."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    for folder in (repo / "blobs", snapshot, repo / "refs", repo / "trees"):
        folder.mkdir(parents=True)
    listing = {}
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        git_sha = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        listing[file.name] = {"size": len(data), "blob_id": git_sha}
        if file.name in missing:
            continue
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "trees" / f"{COMMIT}.json").write_text(
        json.dumps({"format_version": 1, "files": listing}))
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    """An empty HF cache, the hub off and unreachable, in this process and its children."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    for key, value in {**OFFLINE_ENV, "HF_HUB_CACHE": str(cache)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "ENDPOINT", OFFLINE_ENV["HF_ENDPOINT"])
    monkeypatch.setattr(hub, "_resolved", {})
    return cache


def test_hub_ids_and_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for path in ("Qwen/Qwen2.5-3B-Instruct", "meta-llama/Llama-3.2-1B", "a.b/c_d-1"):
        assert is_hub_id(path), path
    (tmp_path / "checkpoints").mkdir()  # then checkpoints/NAME is a local path
    for path in ("checkpoints/Qwen2.5-3B", "./Qwen/Qwen2.5-3B", "/models/Qwen2.5-3B",
                 "Qwen/Qwen2.5-3B/hf", "tiny", "qwen2.5-3b", "Qwen/../x", "-a/b"):
        assert not is_hub_id(path), path


def test_a_cached_hub_model_loads_offline(offline_cache, capsys):
    """The id resolves to its snapshot folder wherever model.path is read (pre-flight,
    memory plan, loading), and loads the cached weights."""
    snapshot = cache_model(offline_cache, MODEL_ID, build_tiny())
    assert check_model_path(MODEL_ID) == snapshot
    assert capsys.readouterr().out == (f"model.path {MODEL_ID}: from the Hugging Face hub, "
                                       f"kept in the HF cache ({offline_cache})\n")
    assert model_config(MODEL_ID).hidden_size == model_config("tiny").hidden_size
    model, tok = load_policy(MODEL_ID, "float32")
    reference, ref_tok = load_policy("tiny", "float32")
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert tok("What is 2 + 3?")["input_ids"] == ref_tok("What is 2 + 3?")["input_ids"]
    assert capsys.readouterr().out == ""  # resolved once a process


def test_offline_without_the_files_names_the_way_out(offline_cache):
    with pytest.raises(HubModelError) as info:
        check_model_path("Qwen/Qwen2.5-3B-Instruct")
    assert str(info.value) == (
        f"model.path 'Qwen/Qwen2.5-3B-Instruct': no local folder of that name, and the hub "
        f"model Qwen/Qwen2.5-3B-Instruct is not in the HF cache ({offline_cache}) and the "
        f"hub is off (HF_HUB_OFFLINE=1); fetch it where the hub is reachable (hf download "
        f"Qwen/Qwen2.5-3B-Instruct --local-dir DIR), bring DIR here and set model.path: DIR")


def test_a_download_cut_short_is_named_so(offline_cache):
    snapshot = cache_model(offline_cache, MODEL_ID, build_tiny(), missing=("model.safetensors",))
    with pytest.raises(HubModelError) as info:
        check_model_path(MODEL_ID)
    assert (f"the hub model {MODEL_ID} is only partly in the HF cache ({snapshot}) and the "
            f"hub is off (HF_HUB_OFFLINE=1); fetch it where the hub is reachable"
            in str(info.value))


def test_a_cached_folder_without_config_is_refused(offline_cache, tmp_path):
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"x")
    cache_model(offline_cache, MODEL_ID, tmp_path / "weights")
    with pytest.raises(HubModelError, match="the hub model has no config.json"):
        check_model_path(MODEL_ID)


def test_commands_take_a_cached_hub_id_and_refuse_a_missing_one(offline_cache, tmp_path):
    """eval.py scores the cached model by its id; train.py stops before any model loads,
    with the one line (exit 2). Fresh processes: the environment alone sets the cache."""
    cache_model(offline_cache, MODEL_ID, build_tiny())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, "eval.py", "--model", MODEL_ID, "--benchmarks", "arithmetic",
         "--limit", "2", "--max-new-tokens", "4", "--output", str(tmp_path / "eval"),
         "--no-progress"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "eval" / "arithmetic" / "samples.jsonl").is_file()
    res = subprocess.run(
        [sys.executable, "train.py", "--config", "tiny_rkv", "--set",
         "model.path=Qwen/Qwen2.5-3B-Instruct", "--set", f"output_dir={tmp_path / 'run'}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 2
    assert res.stderr.splitlines()[-1].startswith(
        "error: model.path 'Qwen/Qwen2.5-3B-Instruct': no local folder of that name")


def _rank_worker(rank: int, init_file: str, out: str, repo_id: str) -> None:
    from minisparse.models import hub as worker_hub

    os.environ["LOCAL_RANK"] = str(rank)
    calls = []
    snapshot = worker_hub.snapshot

    def logged(repo, local_only):
        calls.append(local_only)
        return snapshot(repo, local_only)

    worker_hub.snapshot = logged
    with spawned_rank(rank, 2, init_file):
        try:
            result = str(worker_hub.hub_model_dir(repo_id))
        except HubModelError as exc:
            result = f"error: {exc}"
        Path(out, f"rank{rank}.txt").write_text(f"{calls}\n{result}")


@pytest.mark.parametrize("cached", [True, False])
def test_rank_0_fetches_and_the_others_read_the_cache(offline_cache, tmp_path, cached):
    """Two gloo ranks: rank 0 alone asks the hub side (local_only False), rank 1 reads
    the cache once rank 0 is done; a failure reaches both ranks, and neither hangs."""
    import torch.multiprocessing as mp

    snapshot = cache_model(offline_cache, MODEL_ID, build_tiny()) if cached else None
    mp.spawn(_rank_worker, args=(str(tmp_path / "init"), str(tmp_path), MODEL_ID), nprocs=2)
    ranks = [(tmp_path / f"rank{r}.txt").read_text().split("\n", 1) for r in (0, 1)]
    if cached:
        assert ranks == [["[False]", str(snapshot)], ["[True]", str(snapshot)]]
    else:
        assert ranks[0][0] == "[False]" and ranks[1][0] == "[]"  # rank 1 never looked
        assert ranks[0][1] == ranks[1][1]
        assert ranks[0][1].startswith(f"error: model.path '{MODEL_ID}': no local folder")
