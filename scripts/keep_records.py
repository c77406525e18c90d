"""Records of runs and evaluations small enough to keep in a repository.

Copies each run or eval.py folder given into OUT/ itself: every metrics.jsonl,
metrics.json and summary.json as it is, and every samples.jsonl cut to problem_index,
sample_index and correct, which is what the paired differences of `python -m
minisparse.plot --group --table` and `--evals` need; the benchmark's rows and the answers
stay behind, and so do checkpoints, TensorBoard and logs. docs/runs/real/ was kept so.

    python3 -m scripts.keep_records outputs/ablation/*_seed* --out docs/runs/real
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

KEPT = ("metrics.jsonl", "metrics.json", "summary.json")
SAMPLES = "samples.jsonl"
FIELDS = ("problem_index", "sample_index", "correct")
LEFT = ("checkpoints", "tensorboard")


class RecordsError(ValueError):
    """A source that is not a folder, or a samples.jsonl line that is not a graded sample."""


def cut_samples(source: Path, dest: Path) -> int:
    """dest: source's graded samples with FIELDS only; returns how many."""
    lines = []
    for number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            lines.append(json.dumps({key: record[key] for key in FIELDS}))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise RecordsError(f"{source}:{number}: not a graded sample ({exc})") from None
    dest.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return len(lines)


def keep(folder: Path, out: Path) -> tuple[int, int]:
    """out/folder's name: folder's records; returns (files copied, samples kept)."""
    if not folder.is_dir():
        raise RecordsError(f"{folder}: not a folder")
    files = samples = 0
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if not path.is_file() or set(relative.parts) & set(LEFT):
            continue
        if path.name not in KEPT + (SAMPLES,):
            continue
        target = out / folder.name / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.name == SAMPLES:
            samples += cut_samples(path, target)
        else:
            shutil.copyfile(path, target)
        files += 1
    return files, samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, metavar="FOLDER",
                        help="a run's output_dir or an eval.py --output folder")
    parser.add_argument("--out", type=Path, required=True, help="where the records go")
    args = parser.parse_args(argv)
    try:
        for folder in args.folders:
            files, samples = keep(folder, args.out)
            print(f"{folder} -> {args.out / folder.name}: {files} files, "
                  f"{samples:,} graded samples cut to {', '.join(FIELDS)}")
    except RecordsError as exc:
        print(f"keep_records: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
