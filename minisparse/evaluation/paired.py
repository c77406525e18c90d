"""Whether one checkpoint scores differently from another, and whether it is worse by more
than a margin: the statistics that compare two variants of a run on a held-out benchmark.

Two checkpoints scored on the same problems share each problem's difficulty, so their
per-problem differences vary far less than either score: the paired interval is the one
to read (on MATH500 about +-2.9 points, against +-3.8 for each score). Over several seeds
the pairs are (seed, problem); a problem's differences in different seeds may agree (a
problem the variant helps on), so the variance is taken over problems, each summing its
seeds' differences (cluster-robust; with one seed it is the plain paired test). Where a
checkpoint's graded samples were not kept, only the two scores and their own intervals
remain: `score_difference` combines them as if the problems were unrelated, which ignores
what the two share and so gives a wider interval than pairing would.

Normal approximation throughout (benchmarks of hundreds of problems). Non-inferiority: a
variant is no worse than the baseline by more than `margin` when the one-sided 95% lower
bound of its difference lies above -margin.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

Z95 = 1.96  # two-sided 95%, the factor of every interval eval.py prints
Z95_ONE_SIDED = NormalDist().inv_cdf(0.95)  # 1.645: the lower bound of a one-sided 95%


@dataclass(frozen=True)
class Difference:
    """A difference of accuracies (other minus base, as a fraction) with its standard
    error (None: too few problems to estimate one) and the pairs or seeds behind it."""

    mean: float
    se: float | None
    count: int

    @property
    def ci95(self) -> float | None:
        """Half-width of the two-sided 95% interval."""
        return None if self.se is None else Z95 * self.se

    @property
    def p_value(self) -> float | None:
        """Two-sided p of 'no difference'."""
        if self.se is None:
            return None
        if self.se == 0:
            return 1.0 if self.mean == 0 else 0.0
        return 2 * NormalDist().cdf(-abs(self.mean) / self.se)

    @property
    def lower_bound(self) -> float | None:
        """The one-sided 95% lower bound of the difference."""
        return None if self.se is None else self.mean - Z95_ONE_SIDED * self.se

    def non_inferior(self, margin: float) -> bool | None:
        """Whether the lower bound clears -margin (None without an interval)."""
        bound = self.lower_bound
        return None if bound is None else bound > -margin


def paired_differences(base: Mapping[Hashable, float], other: Mapping[Hashable, float]
                       ) -> dict[Hashable, float]:
    """Problem -> other's accuracy minus base's; both must have scored the same problems."""
    if set(base) != set(other):
        only_one = len(set(base) ^ set(other))
        raise ValueError(f"paired difference needs the same problems: {only_one} scored by "
                         "one side only")
    return {problem: other[problem] - base[problem] for problem in base}


def paired_test(seeds: Sequence[Mapping[Hashable, float]]) -> Difference:
    """The mean of every (seed, problem) difference, its standard error clustered by
    problem: seeds is one paired_differences mapping a seed."""
    pairs = [d for seed in seeds for d in seed.values()]
    if not pairs:
        raise ValueError("paired test needs at least one problem")
    mean = sum(pairs) / len(pairs)
    clusters: dict[Hashable, float] = {}
    for seed in seeds:
        for problem, d in seed.items():
            clusters[problem] = clusters.get(problem, 0.0) + d - mean
    if len(clusters) < 2:
        return Difference(mean, None, len(pairs))
    k = len(clusters)
    variance = k / (k - 1) * sum(s * s for s in clusters.values()) / len(pairs) ** 2
    return Difference(mean, math.sqrt(variance), len(pairs))


Score = tuple[float, float | None]  # one evaluation's accuracy and its 95% half-width


def score_difference(seeds: Sequence[tuple[Score, Score]]) -> Difference:
    """The mean over seeds of other's score minus base's, each seed a (base, other) pair
    of scores, its standard error from the scores' own intervals as if unrelated (wider
    than the paired one); None where a score has no interval."""
    if not seeds:
        raise ValueError("score difference needs at least one seed")
    gaps = [other[0] - base[0] for base, other in seeds]
    widths = [w for base, other in seeds for w in (base[1], other[1])]
    se = None
    if all(w is not None for w in widths):
        se = math.sqrt(sum((w / Z95) ** 2 for w in widths)) / len(seeds)
    return Difference(sum(gaps) / len(gaps), se, len(seeds))
