"""Flags built from the schema: each one's name, type, choices, range, default and help
come from the key's field and HELP entry, and only the flags given override the config."""
import argparse
import dataclasses
import typing

import pytest

from minisparse.config import cli
from minisparse.config.cli import (HelpFormatter, add_config_flags, config_overrides,
                                   flag_name)
from minisparse.config.load import (key_default, leaf_type, load_config, range_rules,
                                    section_keys)
from minisparse.config.schema import HELP, CompressConfig, Config


def _parser(keys):
    parser = argparse.ArgumentParser(prog="t", formatter_class=HelpFormatter)
    add_config_flags(parser, keys)
    return parser


def _help(parser) -> str:
    return " ".join(parser.format_help().split())


def _action(parser, key):
    return next(a for a in parser._actions if a.dest == key)


def test_every_help_entry_is_a_schema_key():
    for key in HELP:
        leaf_type(key)  # a ConfigError for a key the schema lacks


@pytest.mark.parametrize("key", sorted(HELP))
def test_flag_follows_its_field(key):
    parser = _parser([key])
    action, kind, default = _action(parser, key), leaf_type(key), key_default(key)
    assert action.default is None  # left out: the config's value stays
    if kind is bool:
        assert action.option_strings == [f"--no-{flag_name(key)}" if default
                                         else f"--{flag_name(key)}"]
        assert action.const is (not default)
        return
    assert action.option_strings == [f"--{flag_name(key)}"]
    if typing.get_origin(kind) is typing.Literal:
        assert tuple(action.choices) == typing.get_args(kind)
    else:
        assert action.choices is None
        assert action.type is (kind if kind in (int, float) else str)
    text = " ".join(action.help.split())
    assert text.startswith(HELP[key].replace("%", "%%"))
    if key in range_rules():
        assert range_rules()[key].text in text
    if default not in (None, []):
        assert f"default: {default}" in text


def test_names_follow_the_keys():
    assert [flag_name(k) for k in ("compress.budget", "engine.kv_memory_gb", "top_p")] == [
        "budget", "kv-memory-gb", "top-p"]
    assert [flag_name(k) for k in cli.FLAG_NAMES] == ["model", "compress", "overlap"]


def test_a_changed_schema_default_changes_the_help(monkeypatch):
    budget = next(f for f in dataclasses.fields(CompressConfig) if f.name == "budget")
    monkeypatch.setattr(budget, "default", 300)
    assert "(>= 1; default: 300)" in _help(_parser(["compress.budget"]))


def test_bool_flags_flip_their_default(monkeypatch):
    monkeypatch.setitem(HELP, "data.apply_chat_template", "wrap prompts in the template")
    parser = _parser(["engine.cuda_graphs", "data.apply_chat_template"])
    args = parser.parse_args(["--no-cuda-graphs", "--apply-chat-template"])
    assert config_overrides(args, ["engine.cuda_graphs", "data.apply_chat_template"]) == [
        "engine.cuda_graphs=false", "data.apply_chat_template=true"]
    text = _help(parser)
    assert "--no-cuda-graphs replay decode steps from CUDA graphs: on by default" in text
    assert "--apply-chat-template wrap prompts in the template: off by default" in text


def test_only_given_flags_override():
    keys = section_keys("compress")
    args = _parser(keys).parse_args(["--compress", "rkv", "--budget", "64",
                                     "--mix-lambda", "0.25", "--selection", "per_layer"])
    overrides = config_overrides(args, keys)
    assert overrides == ["compress.algorithm=rkv", "compress.budget=64",
                         "compress.mix_lambda=0.25", "compress.selection=per_layer"]
    cfg = load_config("tiny_dense", overrides)
    assert cfg.compress == dataclasses.replace(
        load_config("tiny_dense").compress, algorithm="rkv", budget=64, mix_lambda=0.25,
        selection="per_layer")
    assert config_overrides(_parser(keys).parse_args([]), keys) == []


def test_list_flag_reaches_the_list_key():
    args = _parser(["eval.benchmarks"]).parse_args(["--benchmarks", "gsm8k,amc23"])
    cfg = load_config(None, config_overrides(args, ["eval.benchmarks"]))
    assert cfg.eval.benchmarks == ["gsm8k", "amc23"]


def test_key_default_reads_the_field():
    assert key_default("compress.budget") == CompressConfig().budget
    assert key_default("seed") == Config().seed
    assert key_default("eval.benchmarks") == []
    assert key_default("compress.max_buffer") is None
