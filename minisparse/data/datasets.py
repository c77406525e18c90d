"""JSONL prompt datasets and the seeded, resumable order in which prompts are drawn.

A row is {input_key: prompt, label_key: answer}. The prompt is either a string (the
SimpleRL Qwen file ships it with the chat template already applied) or a list of chat
messages (the Llama file), which always goes through the tokenizer's chat template.
A row no run can train on (data/left_out.py) is left out and counted, and the run says
so in one line naming file:line; data.strict stops at it instead. A row that does not
fit the data.* keys (a missing key, a prompt or label of another type) always stops the
run with file:line: the settings, not the row, are wrong.
"""
from __future__ import annotations

import codecs
import json
import logging
import math
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from minisparse.config.schema import DataConfig
from minisparse.data.left_out import (NO_LABEL, NO_PROMPT, NOT_FINITE, NOT_JSON, NOT_UTF8,
                                      TOO_LONG, LeftOut, UnusableRow)
from minisparse.data.sources import find_source
from minisparse.data.synthetic import Difficulty, synthetic_rows
from minisparse.utils.distributed import rank

logger = logging.getLogger(__name__)

SYNTHETIC_SEED = 0  # the synthetic set is a fixed dataset; run seeds only shuffle it


class DataError(ValueError):
    """A dataset problem, with the file and line it comes from."""


@dataclass
class PromptRow:
    prompt_text: str
    prompt_ids: list[int]
    label: str
    index: int  # row number in the source (0-based, blank lines not counted)
    extra: dict = field(default_factory=dict)  # the record's other keys (reward metadata)


def require_data_file(path: str) -> None:
    """Fail before any model loads when the training file is missing, naming the command
    that writes it when it is a set the downloader knows by name (minisparse.download
    writes OUT/DATASET.jsonl); a file of the user's own gets no such advice."""
    if path == "synthetic" or os.path.isfile(path):
        return
    hint, where = "", Path(path)
    if where.is_dir():
        found = sorted(p.name for p in where.glob("*.jsonl") if p.is_file())
        inside = (f"; the .jsonl files in it: {', '.join(found[:5])}"
                  f"{f' and {len(found) - 5} more' if len(found) > 5 else ''}" if found
                  else "; it holds no .jsonl file")
        raise DataError(f"data.path: {path} is a folder; give the JSONL file{inside}")
    if where.suffix == ".jsonl" and find_source(where.stem) is not None:
        hint = (f"; fetch it with: python -m minisparse.download --dataset {where.stem} "
                f"--out {where.parent}/")
    raise DataError(f"data.path: no such file: {path}{hint}")


# A line over a bound derived from data.max_prompt_len is left out unread, as an over-long
# prompt is dropped, so one huge line costs a skip, not the minutes and gigabytes of
# tokenizing it whole (a 40 MB line took 103 s and 9.8 GB) only to drop it as too long.
# 64 bytes a token is far above any real prompt (English runs ~4 bytes a token; JSON's
# \uXXXX escapes 6-12 bytes a character, about a token each), and 1 MiB more leaves room
# for the label and the row's other keys (a reward plug-in's metadata, such as a
# problem's test cases).
LINE_BYTES_PER_TOKEN = 64
LINE_SLACK_BYTES = 1 << 20
SKIP_CHUNK_BYTES = 1 << 20  # an over-long line is read past in pieces of this size


def max_line_bytes(cfg: DataConfig) -> int:
    """The longest line of cfg.path that is read (see LINE_BYTES_PER_TOKEN)."""
    return LINE_BYTES_PER_TOKEN * cfg.max_prompt_len + LINE_SLACK_BYTES


def _lines(handle: BinaryIO, limit: int) -> Iterator[bytes | None]:
    """Each line of `handle`, or None for one over `limit` bytes: read past in pieces,
    never held whole, so its cost in time and memory stays bounded."""
    while line := handle.readline(limit + 1):
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while (piece := handle.readline(SKIP_CHUNK_BYTES)) and not piece.endswith(b"\n"):
            pass
        yield None


def _decode(line: bytes, where: str) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnusableRow(f"{where}: not UTF-8 text (byte 0x{line[exc.start]:02x} at byte "
                          f"{exc.start + 1} of the line)", NOT_UTF8) from None


def _parse(text: str, where: str) -> dict:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UnusableRow(f"{where}: invalid JSON ({exc.msg})", NOT_JSON) from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


Record = dict | UnusableRow  # a row's JSON object, or why the line holds none


def _iter_records(path: str, limit: int) -> Iterator[tuple[str, Record]]:
    """(location, record) per non-blank line; location is 'file:line' for messages. A line
    over `limit` bytes is left unread (see max_line_bytes)."""
    try:
        with open(path, "rb") as handle:
            for lineno, line in enumerate(_lines(handle, limit), start=1):
                where = f"{path}:{lineno}"
                if lineno == 1 and line and line.startswith(codecs.BOM_UTF8):
                    line = line[len(codecs.BOM_UTF8):]  # a byte-order mark, not the row's
                if line is None:
                    yield where, UnusableRow(f"{where}: the line is over {limit} bytes, the "
                                             f"bound for data.max_prompt_len", TOO_LONG)
                    continue
                try:
                    if (text := _decode(line, where)).strip():
                        yield where, _parse(text, where)
                except UnusableRow as exc:
                    yield where, exc
    except OSError as exc:
        raise DataError(f"cannot read dataset file {path}: {exc}") from None


def _field(record: dict, key: str, where: str) -> Any:
    if key not in record:
        raise DataError(f"{where}: missing key '{key}' (keys present: "
                        f"{', '.join(sorted(record)) or 'none'})")
    return record[key]


def _label(value: Any, where: str) -> str:
    """Numbers become strings (amc23-style numeric answers). An empty or null label and
    NaN or infinity (JSON's NaN, Infinity, or the text "nan" a NaN becomes as a string)
    make the row unusable: no response could match them, so it would only ever earn zero
    reward. Any other type is an error."""
    if value is None or isinstance(value, str) and not value.strip():
        raise UnusableRow(f"{where}: label is empty ({value!r})", NO_LABEL)
    if isinstance(value, str):
        if value.strip().lower() in ("nan", "+nan", "-nan"):
            raise UnusableRow(f"{where}: label is {value!r}, not a number", NOT_FINITE)
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise UnusableRow(f"{where}: label is {value!r}, not a finite number", NOT_FINITE)
        return str(value)
    raise DataError(f"{where}: label must be a string or a number, got "
                    f"{type(value).__name__} {value!r:.80}")


def _check_messages(messages: list, where: str) -> list[dict[str, str]]:
    if not messages:
        raise UnusableRow(f"{where}: empty prompt (an empty message list)", NO_PROMPT)
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) \
                or not isinstance(msg.get("content"), str):
            raise DataError(f"{where}: message {i} must be an object with string 'role' "
                            f"and 'content', got {msg!r:.80}")
    if not any(msg["content"].strip() for msg in messages):
        raise UnusableRow(f"{where}: empty prompt (all message contents are blank)",
                          NO_PROMPT)
    return messages


Prompt = str | list[dict[str, str]]


def check_row(record: dict, cfg: DataConfig, where: str) -> tuple[Prompt, str]:
    """(prompt, label) of one record, checked as far as possible without a tokenizer:
    UnusableRow for a row no run can train on, DataError for one that does not fit the
    data.* keys. The downloader writes only rows that pass."""
    value, prompt = _field(record, cfg.label_key, where), _field(record, cfg.input_key, where)
    label = _label(value, where)
    if prompt is None or isinstance(prompt, str) and not prompt.strip():
        raise UnusableRow(f"{where}: empty prompt", NO_PROMPT)
    if isinstance(prompt, list):
        _check_messages(prompt, where)
    elif not isinstance(prompt, str):
        raise DataError(f"{where}: prompt must be a string or a list of messages, got "
                        f"{type(prompt).__name__}")
    return prompt, label


def _render(prompt: Prompt, cfg: DataConfig, tokenizer: Any,
            where: str) -> tuple[str, list[int]]:
    """Prompt text and ids. Templated text already holds any BOS token, so special
    tokens are added by the tokenizer only for raw strings."""
    if isinstance(prompt, str):
        if not cfg.apply_chat_template:
            return prompt, tokenizer(prompt, add_special_tokens=True)["input_ids"]
        prompt = [{"role": "user", "content": prompt}]
    try:
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja errors, or a tokenizer without a template
        raise DataError(f"{where}: chat template failed: {exc}") from None
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]


def read_rows(path: str) -> Iterator[tuple[Prompt, str]]:
    """(prompt, label) of each row of a {prompt, label} file a run could train on, for
    scoring a model on it (eval.py); the others are left out as training leaves them."""
    for _, _, _, prompt, label in _usable(DataConfig(path=path), LeftOut()):
        yield prompt, label


def render_prompt(prompt: Prompt, tokenizer: Any) -> list[int]:
    """A row's prompt ids as training renders it with the default data settings (a
    string as written, chat messages through the chat template)."""
    return _render(prompt, DataConfig(), tokenizer, "prompt")[1]


def _records(cfg: DataConfig) -> Iterator[tuple[str, Record]]:
    """(location, record) per row; UnusableRow for a line that holds none."""
    if cfg.path == "synthetic":
        rows = synthetic_rows(cfg.synthetic_size, SYNTHETIC_SEED, Difficulty.from_config(cfg))
        for i, row in enumerate(rows):
            yield f"<synthetic>:{i + 1}", {cfg.input_key: row["prompt"],
                                           cfg.label_key: row["label"]}
    else:
        require_data_file(cfg.path)
        yield from _iter_records(cfg.path, max_line_bytes(cfg))


def _usable(cfg: DataConfig,
            left_out: LeftOut) -> Iterator[tuple[int, str, dict, Prompt, str]]:
    """(index, location, record, prompt, label) of each row a run can train on; the others
    are counted in `left_out`, or with cfg.strict stop the run (DataError), except a line
    too long to read: it is dropped as prompts over max_prompt_len are, strict or not."""
    for index, (where, record) in enumerate(_records(cfg)):
        left_out.rows += 1
        try:
            if isinstance(record, UnusableRow):
                raise record
            prompt, label = check_row(record, cfg, where)
        except UnusableRow as exc:
            if cfg.strict and exc.reason != TOO_LONG:
                raise DataError(str(exc)) from None
            left_out.add(exc.reason, where)
            continue
        yield index, where, record, prompt, label


def check_data(cfg: DataConfig) -> LeftOut:
    """The rows of cfg.path and those left out (data/left_out.py), every row parsed and
    checked; a row that does not fit the data.* keys, an empty file or one without a
    usable row fails. Needs no tokenizer, so a run checks its data before any model
    loads; load_prompts then only renders."""
    left_out = LeftOut()
    for _ in _usable(cfg, left_out):
        pass
    _require_rows(cfg, left_out)
    return left_out


def _require_rows(cfg: DataConfig, left_out: LeftOut) -> None:
    if not left_out.rows:
        raise DataError(f"{cfg.path}: no rows (empty file)")
    if not left_out.usable:
        raise DataError(f"{cfg.path}: no usable rows: all {left_out.rows} left out "
                        f"({left_out.reasons()})")


def load_prompts(cfg: DataConfig, tokenizer: Any, stats: dict | None = None) -> list[PromptRow]:
    """Every usable row of cfg.path (check_data says which are not), rendered and
    tokenized. Prompts over max_prompt_len tokens are dropped and counted (logged, and put
    in `stats` when given, with the rows read and those left out)."""
    rows: list[PromptRow] = []
    left_out, dropped, first = LeftOut(), 0, ""
    for index, where, record, prompt, label in _usable(cfg, left_out):
        text, ids = _render(prompt, cfg, tokenizer, where)
        if len(ids) > cfg.max_prompt_len:
            dropped, first = dropped + 1, first or where
            continue
        extra = {k: v for k, v in record.items() if k not in (cfg.input_key, cfg.label_key)}
        rows.append(PromptRow(prompt_text=text, prompt_ids=list(ids), label=label, index=index,
                              extra=extra))
    _require_rows(cfg, left_out)
    if dropped and rank() == 0:  # every rank drops the same ones
        logger.warning("%s: dropped %d of %d prompts longer than max_prompt_len=%d tokens "
                       "(first: %s)", cfg.path, dropped, left_out.usable, cfg.max_prompt_len,
                       first)
    if not rows:
        raise DataError(f"{cfg.path}: no usable prompts: all {dropped} usable rows are "
                        f"longer than max_prompt_len={cfg.max_prompt_len} tokens")
    if stats is not None:
        stats.update(rows=left_out.rows, kept=len(rows), left_out=left_out.total,
                     dropped_too_long=dropped)
    return rows


class PromptSampler:
    """Draws global batches of row indices epoch by epoch; each rank gets its slice.

    The global order depends only on (seed, epoch), never on world_size, so every
    rank computes the same sequence without communication and a resumed run (even on
    a different number of GPUs) continues exactly where it stopped.
    """

    def __init__(self, num_rows: int, batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True) -> None:
        if num_rows < 1 or batch_size < 1:
            raise ValueError(f"need num_rows >= 1 and batch_size >= 1, got {num_rows}, "
                             f"{batch_size}")
        if batch_size % world_size or not 0 <= rank < world_size:
            raise ValueError(f"batch_size {batch_size} must split evenly over world_size "
                             f"{world_size} (rank {rank})")
        self.num_rows, self.batch_size, self.seed = num_rows, batch_size, seed
        self.rank, self.world_size, self.shuffle = rank, world_size, shuffle
        self.epoch, self.offset = 0, 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.num_rows))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_global_batch(self) -> list[int]:
        """All ranks' indices of the next batch, crossing epoch boundaries as needed."""
        batch: list[int] = []
        while len(batch) < self.batch_size:
            if self.offset == self.num_rows:
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.batch_size - len(batch), self.num_rows - self.offset)
            batch.extend(self._order[self.offset:self.offset + take])
            self.offset += take
        return batch

    def next_batch(self) -> list[int]:
        """This rank's contiguous share of the next global batch."""
        share = self.batch_size // self.world_size
        return self.next_global_batch()[self.rank * share:(self.rank + 1) * share]

    def state_dict(self) -> dict[str, int | bool]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed,
                "num_rows": self.num_rows, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_rows", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r}, this run has "
                                 f"{getattr(self, key)!r}: the dataset or seed changed")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._epoch_order(self.epoch)
