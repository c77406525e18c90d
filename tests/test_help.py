"""Every command's --help: each flag says what it does, and the default it has."""
import argparse

import pytest

import eval as eval_cli
import train
from minisparse import download
from minisparse.plot import curves
from minisparse.bench import profile as bench_profile
from minisparse.bench import run as bench

PARSERS = {"train.py": train.build_parser, "eval.py": eval_cli.build_parser,
           "minisparse.plot": curves.build_parser, "minisparse.download": download.build_parser,
           "minisparse.bench": bench.build_parser,
           "minisparse.bench.profile": bench_profile.build_parser}


def _undocumented(parser: argparse.ArgumentParser) -> list[str]:
    """Flags without help, or with a default that their help line does not show."""
    formatter = parser._get_formatter()
    bad = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = formatter._get_help_string(action) if action.help else ""
        name = "/".join(action.option_strings) or action.dest
        if not text.strip():
            bad.append(f"{name}: no help")
        elif (action.option_strings and action.nargs != 0
              and action.default not in (None, [], argparse.SUPPRESS)
              and "default" not in text):
            bad.append(f"{name}: default {action.default!r} not shown")
    return bad


@pytest.mark.parametrize("command", PARSERS)
def test_every_flag_has_help_and_shows_its_default(command):
    assert not _undocumented(PARSERS[command]())


def test_help_ends_in_whole_sentences(capsys):
    """The description is the module docstring's first sentence, not cut mid-line."""
    for build in PARSERS.values():
        description = build().description
        assert description.rstrip().endswith("."), description
