"""The settings a run trained with, kept in its output_dir (config.yaml), so that a later
command in the same folder that would train something else stops instead of passing for
it: a finished run's folder would otherwise print "already holds a finished run" for a
variant that never ran, and a resume would continue the checkpoint under another
algorithm. eval.py --run reads the same file to score the run on its own task.

Runs from before this file was written have none: they are not checked.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from minisparse.config.load import config_to_dict, dotted_items, dump_config
from minisparse.config.schema import Config, ConfigError
from minisparse.utils.files import atomic_write

RUN_CONFIG = "config.yaml"
# Keys that may change between commands in one output_dir, because they do not change
# what is trained, only how long, how fast, how often it saves, evaluates or logs, and
# where: resuming with more rollouts, another GPU or other engine sizes is the point of
# resuming. data.path and data.synthetic_size may grow the data a resume continues on:
# preflight.check_data_order and train.py's resume check that data themselves;
# data.strict only decides whether a row no run can train on stops the run.
RESUMABLE_KEYS = frozenset({
    "data.path", "data.synthetic_size", "data.strict",
    "num_rollout", "save_interval", "save_total_limit", "eval_interval", "eval_before_training",
    "resume",
    "output_dir", "max_nonfinite_steps", "gpu_memory_gb", "max_tokens_per_gpu",
    "logprob_max_tokens_per_gpu",
    "zero_stage", "optimizer_offload", "model.gradient_checkpointing", "model.attention",
    "model.logprob_chunk", "model.liger_kernel", "reward.workers", "reward.timeout_s",
    "cpu_threads",
})
RESUMABLE_SECTIONS = ("eval.", "log.", "engine.", "dist.")  # every key of these sections
SHOWN = 3  # differing settings named in the message; the rest are counted


def run_config_path(output_dir: str | Path) -> Path:
    return Path(output_dir) / RUN_CONFIG


def record_config(cfg: Config) -> None:
    """Write cfg as the settings of the run in cfg.output_dir (rank 0, with the folder
    held: run_lock.py), through a temporary file so a reader never sees half of it."""
    with atomic_write(run_config_path(cfg.output_dir)) as f:
        f.write(dump_config(cfg))


def recorded_settings(output_dir: str | Path) -> dict | None:
    """The recorded config of the run in output_dir as a nested dict; None when there is
    none (no run yet, or one from before runs recorded it)."""
    path = run_config_path(output_dir)
    if not path.is_file():
        return None
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    return raw if isinstance(raw, dict) else None


def resumable(key: str) -> bool:
    return key in RESUMABLE_KEYS or key.startswith(RESUMABLE_SECTIONS)


def changed_settings(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) of every setting that changes what is trained, in the
    schema's order; a key one side lacks (a newer schema) is not a change."""
    before, after = dotted_items(old), dotted_items(new)
    return [(k, before[k], v) for k, v in after.items()
            if k in before and before[k] != v and not resumable(k)]


def _value(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...")


def folder_suggestion(output_dir: str, key: str, value: Any) -> str:
    """A new output_dir named after the first change: outputs/tiny_rkv_knorm,
    outputs/tiny_rkv_dynamic_sampling, outputs/tiny_rkv_budget32."""
    name = key.rsplit(".", 1)[-1]
    if isinstance(value, bool):
        tag = name if value else f"no_{name}"
    elif isinstance(value, str):
        tag = value
    else:
        tag = f"{name}{_value(value)}"
    return f"{output_dir.rstrip('/')}_{re.sub(r'[^A-Za-z0-9.+-]+', '_', tag).strip('_')}"


def settings_change(cfg: Config) -> str | None:
    """Why this config may not continue the run in its output_dir (one line), or None when
    it may: same settings but for RESUMABLE ones, or nothing recorded to compare with."""
    old = recorded_settings(cfg.output_dir)
    if old is None:
        return None
    changes = changed_settings(old, config_to_dict(cfg))
    if not changes:
        return None
    shown = ", ".join(f"{k} {_value(a)} -> {_value(b)}" for k, a, b in changes[:SHOWN])
    more = f" and {len(changes) - SHOWN} more" if len(changes) > SHOWN else ""
    key, _, value = changes[0]
    return (f"{cfg.output_dir} holds a run trained with other settings ({shown}{more}); "
            f"to train this one, give it its own folder: --set output_dir="
            f"{folder_suggestion(cfg.output_dir, key, value)}")


def check_same_settings(cfg: Config) -> None:
    """Raise ConfigError naming the change when settings_change finds one."""
    if why := settings_change(cfg):
        raise ConfigError(why)
