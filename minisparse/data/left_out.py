"""Rows of a training file that no run can train on, and the one line that says so.

A published data set is rarely clean: the paper's own training file has a row with an
empty label. Such a row would only ever earn zero reward, so it is left out rather than
stopping the run (data.strict: true stops at the first instead), and counted here by
reason, with where each reason first occurs, so the run says what it left out, once,
before any model loads, and records the count with its metrics.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# Why a row is left out, as the counts read: "1 without a label", "2 not valid JSON".
NO_LABEL = "without a label"
NOT_FINITE = "with a NaN or infinite label"
NO_PROMPT = "with an empty prompt"
NOT_UTF8 = "not UTF-8"
NOT_JSON = "not valid JSON"
TOO_LONG = "on a line too long for data.max_prompt_len"


class UnusableRow(ValueError):
    """A row no run can train on: `reason` is one of the phrases above, the message
    names the file and line (the error data.strict stops with)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _rows(n: int) -> str:
    return f"{n} row{'s' if n != 1 else ''}"


@dataclass
class LeftOut:
    """The rows read from a file and those left out of them, by reason in the order met,
    each with the location ('file:line') of its first."""

    rows: int = 0
    counts: Counter = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] += 1
        self.first.setdefault(reason, where)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def usable(self) -> int:
        return self.rows - self.total

    def reasons(self) -> str:
        """'1 without a label (first: d.jsonl:5055), 2 not valid JSON (d.jsonl:7)'."""
        parts = [f"{n} {reason} ({'first: ' if not i else ''}{self.first[reason]})"
                 for i, (reason, n) in enumerate(self.counts.items())]
        return ", ".join(parts)

    def line(self) -> str | None:
        """What a run says before any model loads; None when every row is usable."""
        if not self.total:
            return None
        return (f"data: {self.total} of {_rows(self.rows)} left out (cannot be trained on): "
                f"{self.reasons()}; data.strict=true stops at such a row instead")

    def metrics(self) -> dict[str, float]:
        """The run's record of it, logged with every rollout's metrics."""
        return {"data/rows": float(self.rows), "data/rows_left_out": float(self.total)}

    def dropped(self) -> list[str]:
        """The downloader's notes: '1 row without a label dropped'."""
        return [f"{_rows(n)} {reason} dropped" for reason, n in self.counts.items()]
