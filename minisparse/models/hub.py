"""model.path as a Hugging Face hub id (`Qwen/Qwen2.5-3B-Instruct`), as TRL, verl and
OpenRLHF take it: the model's files are fetched once into the HF cache (HF_HUB_CACHE,
~/.cache/huggingface/hub by default) by huggingface_hub and read from there.

One process per machine fetches (LOCAL_RANK 0); the others wait for it and read the
cache, so N ranks do not download N copies. With HF_HUB_OFFLINE=1, or without a network,
a cached copy is used as it is; a model that is not cached is named with the command
that fetches it elsewhere. Only what transformers loads is fetched: config and tokenizer
files and safetensors weights (not the `original/` or consolidated copies some repos add).
"""
from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

ALLOW = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
SKIP = ["original/*", "consolidated*"]
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_resolved: dict[tuple[str, str], Path] = {}  # (id, cache) -> snapshot folder, per process


class HubModelError(FileNotFoundError):
    """A hub id that could not be fetched or found in the cache; one line saying why."""


def is_hub_id(path: str) -> bool:
    """Whether model.path reads as owner/name rather than a local path: one slash, no
    leading ./ or /, and no local folder named like its owner (checkpoints/Qwen2.5-3B
    with a checkpoints/ folder here is a local path that is missing)."""
    owner = path.split("/", 1)[0]
    return (REPO_ID.fullmatch(path) is not None and ".." not in path
            and not Path(owner).exists())


def cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def not_cached_message(repo_id: str, partial: str | None = None) -> str:
    """Why an uncached (or `partial`ly cached: that folder) hub model cannot be read."""
    hub = ("the hub is off (HF_HUB_OFFLINE=1)" if _offline()
           else "the hub cannot be reached")
    where = (f"is only partly in the HF cache ({partial})" if partial
             else f"is not in the HF cache ({cache_dir()})")
    return (f"model.path '{repo_id}': no local folder of that name, and the hub model "
            f"{repo_id} {where} and {hub}; fetch it where "
            f"the hub is reachable (hf download {repo_id} --local-dir DIR), bring DIR here "
            f"and set model.path: DIR")


@contextlib.contextmanager
def _download_bars() -> Iterator[None]:
    """huggingface_hub's progress bars on for the download (quiet_libraries turns them
    off with transformers'), as they were afterwards."""
    from huggingface_hub.utils import (are_progress_bars_disabled, disable_progress_bars,
                                       enable_progress_bars)

    was_off = are_progress_bars_disabled()
    enable_progress_bars()
    try:
        yield
    finally:
        if was_off:
            disable_progress_bars()


def snapshot(repo_id: str, local_only: bool) -> Path:
    """The model's folder in the HF cache, fetched or completed first unless local_only
    (or offline: then the cached copy as it is); HubModelError says why not."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, IncompleteSnapshotError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    try:
        with _download_bars():
            folder = Path(snapshot_download(repo_id, allow_patterns=ALLOW,
                                            ignore_patterns=SKIP,
                                            local_files_only=local_only))
    except GatedRepoError:
        raise HubModelError(f"model.path '{repo_id}' is a gated hub model: accept its terms "
                            f"on https://huggingface.co/{repo_id} and log in (hf auth "
                            f"login)") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise HubModelError(f"model.path '{repo_id}' is neither a local HF checkpoint "
                            f"directory nor a model on the Hugging Face hub (a private one "
                            f"needs hf auth login)") from None
    except IncompleteSnapshotError as exc:  # a download cut short, the hub out of reach
        raise HubModelError(not_cached_message(repo_id, exc.snapshot_path)) from None
    except LocalEntryNotFoundError:
        raise HubModelError(not_cached_message(repo_id)) from None
    if not (folder / "config.json").is_file():
        raise HubModelError(f"model.path '{repo_id}': the hub model has no config.json "
                            f"(in {folder}); it is not a transformers checkpoint")
    return folder


def hub_model_dir(repo_id: str) -> Path:
    """The cached folder of hub model `repo_id`, fetched by one process per machine while
    the others wait (every rank must call this together the first time: the pre-flight
    checks do); later calls in the process reuse the answer."""
    from minisparse.utils.distributed import all_gather_object, is_distributed

    key = (repo_id, cache_dir())
    if key in _resolved:
        return _resolved[key]
    fetcher = not is_distributed() or int(os.environ.get("LOCAL_RANK", "0")) == 0
    outcome: Path | HubModelError | None = None
    if fetcher:
        print(f"model.path {repo_id}: from the Hugging Face hub, kept in the HF cache "
              f"({cache_dir()})", flush=True)
        try:
            outcome = snapshot(repo_id, local_only=False)
        except HubModelError as exc:
            outcome = exc
    for result in all_gather_object(outcome):  # the others wait here for the download
        if isinstance(result, HubModelError):
            raise result
    folder = outcome if isinstance(outcome, Path) else snapshot(repo_id, local_only=True)
    _resolved[key] = folder
    return folder
