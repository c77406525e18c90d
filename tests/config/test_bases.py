"""Configs that name a `base:` config: the file's keys go over its base's, section by
section, then --set overrides; cycles and unknown bases are one-line errors."""
from __future__ import annotations

import pytest
import yaml

from minisparse.config.load import (CONFIGS_DIR, config_to_dict, dotted_items, key_default,
                                    load_config, read_config_file, shipped_configs)
from minisparse.config.schema import Config, ConfigError


def _write(folder, name: str, text: str):
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return path


def test_a_config_sets_only_what_it_changes_in_a_section(tmp_path):
    _write(tmp_path, "parent", "num_rollout: 7\ncompress:\n  algorithm: rkv\n  budget: 64\n")
    child = _write(tmp_path, "child", "base: parent\ncompress:\n  budget: 96\n")
    cfg = load_config(str(child))
    assert (cfg.num_rollout, cfg.compress.algorithm, cfg.compress.budget) == (7, "rkv", 96)
    assert cfg.compress.window == Config().compress.window


def test_an_empty_section_keeps_the_bases_and_set_goes_over_both(tmp_path):
    _write(tmp_path, "parent", "compress:\n  algorithm: rkv\n  budget: 64\n")
    child = _write(tmp_path, "child", "base: parent\ncompress:\n")
    assert load_config(str(child)).compress.budget == 64
    assert load_config(str(child), ["compress.budget=80"]).compress.budget == 80


def test_bases_chain_and_the_nearest_wins(tmp_path):
    _write(tmp_path, "a", "num_rollout: 1\nseed: 1\noutput_dir: outputs/a\n")
    _write(tmp_path, "b", "base: a\nseed: 2\noutput_dir: outputs/b\n")
    c = _write(tmp_path, "c", "base: b.yaml\noutput_dir: outputs/c\n")
    cfg = load_config(str(c))
    assert (cfg.num_rollout, cfg.seed, cfg.output_dir) == (1, 2, "outputs/c")
    assert "base" not in read_config_file(c)


def test_a_base_beside_the_file_comes_before_a_shipped_one(tmp_path):
    _write(tmp_path, "tiny_rkv", "num_rollout: 9\n")
    mine = _write(tmp_path, "mine", "base: tiny_rkv\n")
    assert load_config(str(mine)).num_rollout == 9
    shipped = _write(tmp_path, "uses_shipped", "base: qwen3b_rkv\nseed: 5\n")
    cfg = load_config(str(shipped))
    assert (cfg.seed, cfg.model.path) == (5, load_config("qwen3b_rkv").model.path)


@pytest.mark.parametrize("files,start,message", [
    ({"a": "base: a\n"}, "a", "its bases form a cycle (a -> a)"),
    ({"a": "base: b\n", "b": "base: c\n", "c": "base: a\n"}, "a",
     "its bases form a cycle (a -> b -> c -> a)"),
    ({"a": "base: no_such_config\n"}, "a",
     "its base 'no_such_config' is neither a file nor a config beside it; available "
     "configs: "),
    ({"a": "base: [x]\n"}, "a", "'base' must name a config, got ['x']"),
    ({"a": "base: ''\n"}, "a", "'base' must name a config, got ''"),
])
def test_bad_bases_are_one_line_errors(tmp_path, files, start, message):
    for name, text in files.items():
        _write(tmp_path, name, text)
    with pytest.raises(ConfigError) as info:
        load_config(str(tmp_path / f"{start}.yaml"))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_key_a_base_sets_wrongly_is_named_as_any_other(tmp_path):
    _write(tmp_path, "parent", "compress:\n  budgett: 3\n")
    child = _write(tmp_path, "child", "base: parent\n")
    with pytest.raises(ConfigError, match="did you mean 'compress.budget'"):
        load_config(str(child))


# The twins: each names its family's config and sets a handful of keys.
TWINS = {"qwen3b_dense": "qwen3b_rkv", "qwen3b_snapkv": "qwen3b_rkv",
         "qwen3b_dapo": "qwen3b_rkv", "qwen1.5b_rkv": "qwen3b_rkv",
         "qwen7b_rkv": "qwen3b_rkv", "llama1b_rkv": "qwen3b_rkv",
         "smollm2_rkv": "smollm2_dense", "smollm2_snapkv": "smollm2_rkv",
         "smollm2_cpu_rkv": "smollm2_cpu", "coder1.5b_rkv": "coder1.5b_dense",
         "coder1.5b_snapkv": "coder1.5b_rkv", "tiny_dense": "tiny_rkv"}


def _leaves(tree: dict) -> int:
    return sum(_leaves(v) if isinstance(v, dict) else 1 for v in tree.values())


@pytest.mark.parametrize("name,base", TWINS.items())
def test_twins_name_their_base_and_set_a_handful_of_keys(name, base):
    raw = yaml.safe_load((CONFIGS_DIR / f"{name}.yaml").read_text())
    assert raw.pop("base") == base
    assert _leaves(raw) <= 6, raw


@pytest.mark.parametrize("name", shipped_configs())
def test_every_key_a_config_writes_changes_something(name):
    """A shipped config says only what differs: each key it writes differs from what its
    base resolves to, or, with no base, from the schema's default (never restated)."""
    raw = yaml.safe_load((CONFIGS_DIR / f"{name}.yaml").read_text())
    base = raw.pop("base", None)
    under = dotted_items(config_to_dict(load_config(base))) if base else {}
    same = [key for key, value in dotted_items(raw).items()
            if value == (under[key] if base else key_default(key))]
    assert not same, f"{name} restates {same}"
