"""A user's own reward function in place of the math grader: `reward.function:
package.module:callable` (slime's --custom-rm-path).

The callable is called once per response as fn(response, label, metadata) and returns a
number: response is the decoded response text, label the row's label, metadata a dict
with the prompt text, the row's index in the data file, the sample's number within its
prompt's group, and every other key of the row's JSONL record (so a task can carry test
cases or a rubric next to its label). The module is imported and the signature checked
before any model loads (trainer/preflight.py), so a typo costs a second, not a model load.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from minisparse.config.schema import ConfigError
from minisparse.utils.user_code import UserCodeError, raised

RewardFn = Callable[[str, str, dict], float]
KEY = "reward.function"


class RewardError(UserCodeError):
    """The reward function raised or returned what is not a finite number: one line naming
    it, the sample and where in the user's file."""


@functools.cache
def load_reward_function(spec: str) -> RewardFn:
    """The callable named by `package.module:callable`, imported and checked to take
    (response, label, metadata); a ConfigError says what was wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{KEY} must look like 'package.module:callable', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{KEY}: cannot import module '{module_name}' ({exc})") from None
    except Exception as exc:  # the module itself failed while importing
        raise ConfigError(f"{KEY}: importing module '{module_name}' raised "
                          f"{type(exc).__name__}: {exc}") from None
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ConfigError(f"{KEY}: module '{module_name}' has no attribute '{attr}'")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ConfigError(f"{KEY}: '{spec}' is a {type(fn).__name__}, not a callable")
    if inspect.iscoroutinefunction(fn):
        raise ConfigError(f"{KEY}: '{spec}' is async; give a plain function")
    try:
        inspect.signature(fn).bind("response", "label", {})
    except TypeError as exc:
        raise ConfigError(f"{KEY}: '{spec}' must take (response, label, metadata) "
                          f"positionally: {exc}") from None
    except ValueError:  # no signature to read (some builtins): the first call tells
        pass
    return fn


def call_reward_function(spec: str, responses: Sequence[str], labels: Sequence[str],
                         metadata: Sequence[dict]) -> tuple[list[float], dict[str, float]]:
    """(reward per response, stats) from the plug-in. A raised exception or a result that
    is not a finite number stops the run naming the sample: a reward that silently turns
    into 0 would train on a broken signal."""
    fn = load_reward_function(spec)
    start = time.perf_counter()
    rewards = []
    for i, (response, label, meta) in enumerate(zip(responses, labels, metadata, strict=True)):
        try:
            value = fn(response, label, meta)
        except Exception as exc:
            raise RewardError(f"{KEY} '{spec}' raised on sample {i} (label {label!r:.40}): "
                              f"{raised(exc)}") from exc
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RewardError(f"{KEY} '{spec}' returned {value!r:.80} for sample {i}; "
                              f"expected a finite number")
        rewards.append(float(value))
    n = max(len(rewards), 1)
    stats = {"accuracy": sum(r > 0.5 for r in rewards) / n,
             "grade_s": time.perf_counter() - start}
    return rewards, stats
