"""JSONL prompt datasets and the seeded, resumable order in which prompts are drawn.

A row is {input_key: prompt, label_key: answer}. The prompt is either a string (the
SimpleRL Qwen file ships it with the chat template already applied) or a list of chat
messages (the Llama file), which always goes through the tokenizer's chat template.
Bad rows fail loudly with file:line, because a silently skipped row changes the run.
"""
from __future__ import annotations

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
from minisparse.data.synthetic import Difficulty, synthetic_rows

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
    that writes it (minisparse.download writes OUT/DATASET.jsonl)."""
    if path == "synthetic" or os.path.isfile(path):
        return
    hint = ""
    if path.endswith(".jsonl"):
        where = Path(path)
        hint = (f"; fetch it with: python -m minisparse.download --dataset {where.stem} "
                f"--out {where.parent}/")
    raise DataError(f"data.path: no such file: {path}{hint}")


# A line over a bound derived from data.max_prompt_len is dropped unread, as an over-long
# prompt is, so one huge line costs a skip, not the minutes and gigabytes of tokenizing it
# whole (a 40 MB line took 103 s and 9.8 GB) only to drop it as too long. 64 bytes a token is far above any
# real prompt (English runs ~4 bytes a token; JSON's \uXXXX escapes 6-12 bytes a
# character, about a token each), and 1 MiB more leaves room for the label and the row's
# other keys (a reward plug-in's metadata, such as a problem's test cases).
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
        raise DataError(f"{where}: not UTF-8 text (byte 0x{line[exc.start]:02x} at byte "
                        f"{exc.start + 1} of the line)") from None


def _parse(text: str, where: str) -> dict:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: invalid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


def _iter_records(path: str, limit: int) -> Iterator[tuple[str, dict | None]]:
    """(location, record) per non-blank line; location is 'file:line' for messages. The
    record is None for a line over `limit` bytes, left unread (see max_line_bytes)."""
    try:
        with open(path, "rb") as handle:
            for lineno, line in enumerate(_lines(handle, limit), start=1):
                where = f"{path}:{lineno}"
                if line is None:
                    yield where, None
                elif (text := _decode(line, where)).strip():
                    yield where, _parse(text, where)
    except OSError as exc:
        raise DataError(f"cannot read dataset file {path}: {exc}") from None


def _field(record: dict, key: str, where: str) -> Any:
    if key not in record:
        raise DataError(f"{where}: missing key '{key}' (keys present: "
                        f"{', '.join(sorted(record)) or 'none'})")
    return record[key]


def _label(value: Any, where: str) -> str:
    """Numbers become strings (amc23-style numeric answers); anything else is an error, and
    so are an empty label and NaN or infinity (JSON's NaN, Infinity): no response could
    match them, so their rows would only ever earn zero reward."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: label is empty ({value!r})")
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise DataError(f"{where}: label is {value!r}, not a finite number")
        return str(value)
    raise DataError(f"{where}: label must be a string or a number, got "
                    f"{type(value).__name__} {value!r:.80}")


def _check_messages(messages: list, where: str) -> list[dict[str, str]]:
    if not messages:
        raise DataError(f"{where}: empty message list")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) \
                or not isinstance(msg.get("content"), str):
            raise DataError(f"{where}: message {i} must be an object with string 'role' "
                            f"and 'content', got {msg!r:.80}")
    if not any(msg["content"].strip() for msg in messages):
        raise DataError(f"{where}: empty prompt (all message contents are blank)")
    return messages


def _row(record: dict, cfg: DataConfig, where: str) -> tuple[str | list[dict[str, str]], str]:
    """(prompt, label) of one record, checked as far as possible without a tokenizer."""
    label = _label(_field(record, cfg.label_key, where), where)
    prompt = _field(record, cfg.input_key, where)
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: empty prompt")
    elif isinstance(prompt, list):
        _check_messages(prompt, where)
    else:
        raise DataError(f"{where}: prompt must be a string or a list of messages, got "
                        f"{type(prompt).__name__}")
    return prompt, label


def _render(prompt: str | list[dict[str, str]], cfg: DataConfig, tokenizer: Any,
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


def read_rows(path: str) -> Iterator[tuple[str | list[dict[str, str]], str]]:
    """(prompt, label) of each usable row of a {prompt, label} file, for scoring a model on
    it (eval.py); rows training could not use are passed over. A missing file fails."""
    cfg = DataConfig(path=path)
    require_data_file(path)
    for where, record in _iter_records(path, max_line_bytes(cfg)):
        if record is None:
            continue
        try:
            yield _row(record, cfg, where)
        except DataError:
            continue


def render_prompt(prompt: str | list[dict[str, str]], tokenizer: Any) -> list[int]:
    """A row's prompt ids as training renders it with the default data settings (a
    string as written, chat messages through the chat template)."""
    return _render(prompt, DataConfig(), tokenizer, "prompt")[1]


def _records(cfg: DataConfig) -> Iterator[tuple[str, dict | None]]:
    """(location, record) per row; None for a line too long to read (max_line_bytes)."""
    if cfg.path == "synthetic":
        rows = synthetic_rows(cfg.synthetic_size, SYNTHETIC_SEED, Difficulty.from_config(cfg))
        for i, row in enumerate(rows):
            yield f"<synthetic>:{i + 1}", {cfg.input_key: row["prompt"],
                                           cfg.label_key: row["label"]}
    else:
        require_data_file(cfg.path)
        yield from _iter_records(cfg.path, max_line_bytes(cfg))


def check_data(cfg: DataConfig) -> int:
    """Number of rows in cfg.path, each parsed and holding a usable prompt and label;
    the first bad row (file:line) or an empty file fails. Needs no tokenizer, so a run
    checks its data before any model loads; load_prompts then only renders."""
    total = 0
    for where, record in _records(cfg):
        if record is not None:  # an over-long line: dropped by load_prompts, saying where
            _row(record, cfg, where)
        total += 1
    if not total:
        raise DataError(f"{cfg.path}: no rows (empty file)")
    return total


def load_prompts(cfg: DataConfig, tokenizer: Any, stats: dict | None = None) -> list[PromptRow]:
    """Every row of cfg.path, rendered and tokenized. Prompts over max_prompt_len tokens
    are dropped and counted (logged, and put in `stats` when given), and so are lines too
    long to hold a prompt that fits (max_line_bytes), unread."""
    rows: list[PromptRow] = []
    dropped = total = 0
    for index, (where, record) in enumerate(_records(cfg)):
        total += 1
        if record is None:
            dropped += 1
            logger.warning("%s: dropped unread: the line is over %d bytes, the bound for "
                           "data.max_prompt_len=%d (prompts over max_prompt_len tokens are "
                           "dropped)", where, max_line_bytes(cfg), cfg.max_prompt_len)
            continue
        prompt, label = _row(record, cfg, where)
        text, ids = _render(prompt, cfg, tokenizer, where)
        if len(ids) > cfg.max_prompt_len:
            dropped += 1
            continue
        extra = {k: v for k, v in record.items() if k not in (cfg.input_key, cfg.label_key)}
        rows.append(PromptRow(prompt_text=text, prompt_ids=list(ids), label=label, index=index,
                              extra=extra))
    if dropped:
        logger.warning("%s: dropped %d of %d prompts longer than max_prompt_len=%d tokens",
                       cfg.path, dropped, total, cfg.max_prompt_len)
    if not rows:
        raise DataError(f"{cfg.path}: no usable prompts ({total} rows, {dropped} too long)")
    if stats is not None:
        stats.update(rows=total, kept=len(rows), dropped_too_long=dropped)
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
