"""What `--print-config` prints for every shipped config, against tests/config/resolved/,
written from the configs before any of them named a base: composing the configs changed
no setting. A deliberate change to a shipped config shows here as a diff of its file;
rewrite them with `UPDATE_RESOLVED=1 python -m pytest tests/config/test_resolved_configs.py`
and review the diff. A key added to the schema since is checked against its default."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import yaml

from minisparse.config.cli import add_config_args, config_from_args
from minisparse.config.load import dotted_items, key_default, shipped_configs

RESOLVED = Path(__file__).resolve().parent / "resolved"


def _printed(name: str, capsys: pytest.CaptureFixture) -> str:
    args = add_config_args(argparse.ArgumentParser()).parse_args(
        ["--config", name, "--print-config"])
    with pytest.raises(SystemExit) as info:
        config_from_args(args)
    assert info.value.code == 0
    return capsys.readouterr().out


def test_every_shipped_config_has_its_resolved_file():
    assert sorted(p.stem for p in RESOLVED.glob("*.yaml")) == shipped_configs()


@pytest.mark.parametrize("name", shipped_configs())
def test_print_config_resolves_as_before(name, capsys):
    printed = _printed(name, capsys)
    path = RESOLVED / f"{name}.yaml"
    if os.environ.get("UPDATE_RESOLVED") == "1":
        path.write_text(printed)
    now = dotted_items(yaml.safe_load(printed))
    before = dotted_items(yaml.safe_load(path.read_text()))
    changed = {k: (before[k], now.get(k, "<gone>")) for k in before
               if now.get(k, "<gone>") != before[k]}
    assert not changed, f"{name}: (before, now) {changed}"
    added = {k: v for k, v in now.items() if k not in before and v != key_default(k)}
    assert not added, f"{name}: new keys set away from their defaults {added}"
