"""scripts/mutation_check.py: every mutation on its list still applies to the code as it
is (one line, found once), so the list cannot go stale silently."""
from pathlib import Path

import pytest

from scripts import mutation_check

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.algorithm


@pytest.mark.parametrize("mutation", mutation_check.MUTATIONS, ids=lambda m: m.what)
def test_each_mutation_changes_one_line(mutation):
    before = (REPO / mutation.path).read_text()
    after = mutation_check.apply(before, mutation)
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
    assert len(changed) == 1 and len(after.splitlines()) == len(before.splitlines())


def test_at_least_fifteen_mutations_of_the_algorithm_and_the_loop():
    paths = {m.path for m in mutation_check.MUTATIONS}
    assert len(mutation_check.MUTATIONS) >= 15
    assert "train.py" in paths and all(p == "train.py" or p.startswith("minisparse/grpo/")
                                       for p in paths)


def test_a_stale_mutation_is_refused():
    m = mutation_check.Mutation("x.py", "a = 1", "a = 2", "example")
    assert mutation_check.apply("a = 1\n", m) == "a = 2\n"
    for text in ("b = 1\n", "a = 1\na = 1\n"):
        with pytest.raises(ValueError, match="exactly once"):
            mutation_check.apply(text, m)
