"""reward.function: a user's reward callable, checked before any model loads and called
with (response, label, metadata) per sample."""
import sys
import textwrap

import pytest
import torch

from minisparse.config.load import load_config
from minisparse.config.schema import ConfigError, RewardConfig
from minisparse.data.datasets import PromptRow
from minisparse.data.reward_plugin import RewardError, load_reward_function
from minisparse.engine.sequence import SampleOutput
from minisparse.trainer.preflight import check_run
from minisparse.rollout import build_batch, score_batch
from minisparse.utils.user_code import UserCodeError

PLUGIN = """
seen = []

def length_reward(response, label, metadata):
    seen.append((response, label, metadata))
    return len(response) / int(label) + metadata.get("bonus", 0)

def two_args(response, label):
    return 1.0

def with_defaults(response, label, metadata=None, *, scale=1.0):
    return scale

async def coro(response, label, metadata):
    return 1.0

def bad_value(response, label, metadata):
    return "1"

def raises(response, label, metadata):
    raise KeyError("tests")

not_callable = 3
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A module `my_rewards` importable for this test only."""
    (tmp_path / "my_rewards.py").write_text(PLUGIN)
    (tmp_path / "broken_rewards.py").write_text("import nonexistent_package_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    load_reward_function.cache_clear()
    yield tmp_path
    load_reward_function.cache_clear()


class CharTokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(map(chr, row)) for row in ids]


def _output(prompt: int, sample: int, text: str) -> SampleOutput:
    return SampleOutput(prompt_index=prompt, sample_index=sample, prompt_token_ids=[7],
                        token_ids=list(map(ord, text)), logprobs=[0.0] * len(text),
                        finish_reason="stop")


def test_the_plugin_scores_each_response_with_its_label_and_metadata(plugin):
    rows = [PromptRow("p0", [7], "2", index=5, extra={"bonus": 10}),
            PromptRow("p1", [7], "4", index=9)]
    outputs = [_output(0, 0, "ab"), _output(0, 1, "abcd"), _output(1, 0, "abcdef"),
               _output(1, 1, "")]
    batch = build_batch(outputs, rows)
    stats = score_batch(batch, CharTokenizer(), RewardConfig(function="my_rewards:length_reward"))
    # len / label + bonus: 2/2 + 10, 4/2 + 10, 6/4, 0/4
    assert batch.rewards.tolist() == [11.0, 12.0, 1.5, 0.0]
    assert stats["accuracy"] == 3 / 4  # rewards above 0.5
    import my_rewards
    assert [m for _, _, m in my_rewards.seen] == [
        {"prompt": "p0", "index": 5, "sample_index": 0, "bonus": 10},
        {"prompt": "p0", "index": 5, "sample_index": 1, "bonus": 10},
        {"prompt": "p1", "index": 9, "sample_index": 0},
        {"prompt": "p1", "index": 9, "sample_index": 1},
    ]


def test_without_a_plugin_the_math_grader_scores():
    rows = [PromptRow("p", [7], "2", index=0)]
    batch = build_batch([_output(0, 0, "\\boxed{2}"), _output(0, 1, "3")], rows)
    score_batch(batch, CharTokenizer(), RewardConfig())
    assert batch.rewards.tolist() == [1.0, 0.0]


def test_optional_extra_parameters_are_fine(plugin):
    assert load_reward_function("my_rewards:with_defaults")("r", "l", {}) == 1.0


@pytest.mark.parametrize("spec,message", [
    ("my_rewards", "must look like 'package.module:callable', got 'my_rewards'"),
    ("my_rewards:", "must look like 'package.module:callable'"),
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("broken_rewards:f", "cannot import module 'broken_rewards' (No module named "
                         "'nonexistent_package_xyz')"),
    ("my_rewards:missing", "module 'my_rewards' has no attribute 'missing'"),
    ("my_rewards:not_callable", "'my_rewards:not_callable' is a int, not a callable"),
    ("my_rewards:two_args", "'my_rewards:two_args' must take (response, label, metadata) "
                            "positionally: too many positional arguments"),
    ("my_rewards:coro", "is async"),
])
def test_a_bad_plugin_is_refused_before_any_model_loads(plugin, tmp_path, spec, message):
    cfg = load_config("tiny_rkv", [f"output_dir={tmp_path / 'out'}",
                                   f"reward.function={spec}"])
    with pytest.raises(ConfigError) as info:
        check_run(cfg, 1, resume_required=False)
    assert str(info.value).startswith("reward.function")
    assert message in str(info.value)


@pytest.mark.parametrize("name,message", [
    ("bad_value", "returned '1' for sample 0; expected a finite number"),
    ("raises", "raised on sample 0 (label '2'): KeyError: 'tests'"),
])
def test_a_plugin_failing_at_run_time_stops_naming_the_sample(plugin, name, message):
    batch = build_batch([_output(0, 0, "x")], [PromptRow("p", [7], "2", index=0)])
    with pytest.raises(RewardError) as info:
        score_batch(batch, CharTokenizer(), RewardConfig(function=f"my_rewards:{name}"))
    assert message in str(info.value)
    assert batch.rewards is None


def test_an_exception_names_the_line_of_the_users_file(plugin):
    """train.py prints a UserCodeError as its one line; the user's line is in it."""
    batch = build_batch([_output(0, 0, "x")], [PromptRow("p", [7], "2", index=0)])
    with pytest.raises(UserCodeError) as info:
        score_batch(batch, CharTokenizer(), RewardConfig(function="my_rewards:raises"))
    line = PLUGIN.splitlines().index('    raise KeyError("tests")') + 1
    where = sys.modules["my_rewards"].__file__  # (an earlier test's copy stays imported)
    assert str(info.value) == (f"reward.function 'my_rewards:raises' raised on sample 0 "
                               f"(label '2'): KeyError: 'tests' (at {where}:{line})")
