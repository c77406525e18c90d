"""JSONL prompt datasets and the seeded, resumable order in which prompts are drawn.

A row is {input_key: prompt, label_key: answer}. The prompt is either a string (the
SimpleRL Qwen file ships it with the chat template already applied) or a list of chat
messages (the Llama file), which always goes through the tokenizer's chat template.
Bad rows fail loudly with file:line, because a silently skipped row changes the run.
"""
from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def _iter_records(path: str) -> Iterator[tuple[str, dict]]:
    """(location, record) per non-blank line; location is 'file:line' for messages."""
    try:
        with open(path, encoding="utf-8") as handle:
            for lineno, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{where}: invalid JSON ({exc.msg})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{where}: expected a JSON object, got "
                                    f"{type(record).__name__}")
                yield where, record
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read dataset file {path}: {exc}") from None


def _field(record: dict, key: str, where: str) -> Any:
    if key not in record:
        raise DataError(f"{where}: missing key '{key}' (keys present: "
                        f"{', '.join(sorted(record)) or 'none'})")
    return record[key]


def _label(value: Any, where: str) -> str:
    """Numbers become strings (amc23-style numeric answers); anything else is an error."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
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


def _records(cfg: DataConfig) -> Iterator[tuple[str, dict]]:
    if cfg.path == "synthetic":
        rows = synthetic_rows(cfg.synthetic_size, SYNTHETIC_SEED, Difficulty.from_config(cfg))
        for i, row in enumerate(rows):
            yield f"<synthetic>:{i + 1}", {cfg.input_key: row["prompt"],
                                           cfg.label_key: row["label"]}
    else:
        require_data_file(cfg.path)
        yield from _iter_records(cfg.path)


def check_data(cfg: DataConfig) -> int:
    """Number of rows in cfg.path, each parsed and holding a usable prompt and label;
    the first bad row (file:line) or an empty file fails. Needs no tokenizer, so a run
    checks its data before any model loads; load_prompts then only renders."""
    total = 0
    for where, record in _records(cfg):
        _row(record, cfg, where)
        total += 1
    if not total:
        raise DataError(f"{cfg.path}: no rows (empty file)")
    return total


def load_prompts(cfg: DataConfig, tokenizer: Any, stats: dict | None = None) -> list[PromptRow]:
    """Every row of cfg.path, rendered and tokenized. Prompts over max_prompt_len tokens
    are dropped and counted (logged, and put in `stats` when given)."""
    rows: list[PromptRow] = []
    dropped = total = 0
    for index, (where, record) in enumerate(_records(cfg)):
        total += 1
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
