"""MANIFEST.json: what a checkpoint held when it was written, so that a damaged one is
found before a run trusts it, not as a crash (or worse, silently wrong weights) an hour
into a resume.

save_checkpoint writes the manifest last but one (every file's relative path, size and
sha256) and puts the manifest's own sha256 in the COMPLETE marker, so a missing or edited
manifest shows too. Checking sizes costs a stat per file (0.2 ms for a checkpoint).
Checking hashes reads every byte: sha256 ran at 1.4-1.6 GB/s on one core of the 2-core
test machine (1.1 GB/s while it was shared) and 3.0 GB/s on both, from the page cache;
files are hashed in parallel threads (hashlib releases the GIL), one file per thread:
each rank's optimizer file is one. A 43 GB checkpoint (Qwen2.5-3B: 6 GB of bf16
weights, 37 GB of fp32 masters and Adam moments) over 4 ranks thus takes about 15 s on
2 free cores, or as long as the disk takes to read it where that is slower (43 s at
1 GB/s). A save pays it once more, mostly from the page cache; a resume pays it on rank
0 before any model loads.

Only for integrity (a truncated copy, a bad disk, a half-finished rsync): anyone who can
write the checkpoint can write a matching manifest. Code in a checkpoint is kept out by
safe_load.py.
"""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST = "MANIFEST.json"
HASH_THREADS = min(8, os.cpu_count() or 1)
CHUNK = 1 << 24  # 16 MiB reads: one GIL release per chunk


def sha256_file(path: Path) -> str:
    digest, buffer = hashlib.sha256(), bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _hashes(folder: Path, names: list[str]) -> list[str]:
    """sha256 of each file, in parallel threads (hashing is CPU-bound, reading I/O-bound)."""
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        return list(pool.map(lambda name: sha256_file(folder / name), names))


def write_manifest(folder: Path) -> str:
    """Record every file under `folder` (size, sha256) in folder/MANIFEST.json; returns the
    manifest's own sha256, for the COMPLETE marker."""
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if p.is_file() and p.name != MANIFEST)
    files = {name: {"size": (folder / name).stat().st_size, "sha256": digest}
             for name, digest in zip(names, _hashes(folder, names))}
    text = json.dumps({"version": 1, "files": files}, indent=1).encode()
    (folder / MANIFEST).write_bytes(text)
    return hashlib.sha256(text).hexdigest()


def _read_manifest(folder: Path, expected: str | None) -> dict[str, dict] | str:
    """The manifest's file table, or what is wrong with it."""
    try:
        text = (folder / MANIFEST).read_bytes()
    except FileNotFoundError:
        return f"{MANIFEST}: missing"
    except OSError as exc:
        return f"{MANIFEST}: unreadable ({exc.strerror})"
    if expected is not None and hashlib.sha256(text).hexdigest() != expected:
        return f"{MANIFEST}: sha256 differs from the one COMPLETE records"
    try:
        files = json.loads(text)["files"]
        return {name: {"size": int(e["size"]), "sha256": str(e["sha256"])}
                for name, e in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{MANIFEST}: unreadable ({type(exc).__name__}: {exc})"


def _size_problem(folder: Path, name: str, size: int) -> str | None:
    try:
        actual = (folder / name).stat().st_size
    except FileNotFoundError:
        return f"{name}: missing"
    except OSError as exc:
        return f"{name}: unreadable ({exc.strerror})"
    return None if actual == size else f"{name}: size {actual}, manifest says {size}"


def _hash_problem(folder: Path, files: dict[str, dict]) -> str | None:
    try:
        digests = _hashes(folder, list(files))
    except OSError as exc:
        return f"{Path(exc.filename).relative_to(folder)}: unreadable ({exc.strerror})"
    for (name, entry), digest in zip(files.items(), digests):
        if digest != entry["sha256"]:
            return f"{name}: sha256 differs from the manifest"
    return None


def manifest_problem(folder: Path, expected: str | None, hashes: bool = True) -> str | None:
    """What in `folder` differs from its manifest (the first thing found), or None.
    `expected`: the manifest's sha256 as COMPLETE records it (None: not recorded).
    Sizes always; with `hashes` every file is read and hashed (see the module's costs)."""
    files = _read_manifest(folder, expected)
    if isinstance(files, str):
        return files
    for name, entry in files.items():
        if problem := _size_problem(folder, name, entry["size"]):
            return problem
    return _hash_problem(folder, files) if hashes else None
