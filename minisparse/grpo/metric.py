"""How a metric combines over ranks, carried by its value where the metric is made, so
renaming a metric cannot change it: Sum for counts, Max for maxima, a plain float for
metrics averaged over ranks. Both are floats (they log and compare as floats)."""
from __future__ import annotations


class Sum(float):
    """A count: added up over ranks."""


class Max(float):
    """A maximum: the largest value over ranks."""
