"""Command-line flags built from the schema: --config, --set and --print-config (train.py,
eval.py), and one flag per chosen config key (eval.py, the engine bench) whose name, type,
choices, range, default and help all come from the key's field and HELP entry."""
from __future__ import annotations

import argparse
import os
import sys
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import NoReturn

from minisparse.config.load import (dump_config, key_default, leaf_type, load_config,
                                    range_rules)
from minisparse.config.schema import HELP, Config, ConfigError
from minisparse.utils.torchrun import record_line

# Flags named otherwise than the last part of their key.
FLAG_NAMES = {"model.path": "model", "compress.algorithm": "compress",
              "engine.overlap_decode": "overlap"}

# The engine settings that eval.py and the engine bench both take as flags.
ENGINE_KEYS = ("engine.page_size", "engine.kv_memory_gb", "engine.kv_memory_fraction",
               "engine.kv_cpu_memory_gb", "engine.max_num_seqs", "engine.max_prefill_tokens",
               "engine.cuda_graphs", "engine.fused_kernels", "engine.overlap_decode",
               "engine.share_prompt_cache")


def add_config_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The config flags train.py and eval.py share."""
    parser.add_argument("--config", default=None,
                        help="config name under configs/ (e.g. qwen3b_rkv) or a YAML path")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="override a key, dotted for sections (compress.budget=256); "
                             "repeatable")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML and exit")
    return parser


def first_process() -> bool:
    """Whether this process speaks for the run: torchrun's rank 0 (its RANK, set before
    the process group starts), or a process started alone."""
    return os.environ.get("RANK", "0") == "0"


def exit_with_error(message: str, code: int = 2) -> NoReturn:
    """One 'error: ...' line on stderr, then exit `code`. Under torchrun every process
    meets the same input error (each checks the same config and files, or takes rank 0's
    verdict), so the first alone says it and the others exit with the same code quietly;
    each records it for torchrun's failure report (utils/torchrun.py)."""
    if first_process():
        print(f"error: {message}", file=sys.stderr, flush=True)
    record_line(f"error: {message}")
    raise SystemExit(code)


def config_from_args(args: argparse.Namespace,
                     checks: Sequence[Callable[[Config], None]] = ()) -> Config:
    """Resolved Config; exits 2 with 'error: ...' on a bad config (or one that a
    command's own `checks` reject), 0 after printing."""
    try:
        cfg = load_config(args.config, args.overrides)
        for check in checks:
            check(cfg)
    except ConfigError as exc:
        exit_with_error(str(exc))
    if args.print_config:
        print(dump_config(cfg), end="")
        raise SystemExit(0)
    return cfg


class HelpFormatter(argparse.HelpFormatter):
    """--help showing the default of every flag that takes a value and has one. A config
    key's flag defaults to None (only given flags override the config) and states the
    schema's default in its help instead."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.option_strings and action.nargs != 0 and "%(default)" not in text
                and action.default not in (None, [], argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


class RawEpilogHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """HelpFormatter that keeps the description's and epilog's line breaks (a table)."""


def flag_name(key: str) -> str:
    """The flag of a config key without its dashes: page-size for engine.page_size."""
    return FLAG_NAMES.get(key, key.rsplit(".", 1)[-1]).replace("_", "-")


def add_config_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                     keys: Iterable[str]) -> None:
    """One flag per config key, stored under the key itself (args."compress.budget"), None
    unless given: config_overrides() turns the given ones into KEY=VALUE overrides, which
    load_config then checks like any other. A bool key gets one flag that flips its
    default (--no-cuda-graphs)."""
    rules = range_rules()
    for key in keys:
        name, kind, default = flag_name(key), leaf_type(key), key_default(key)
        text = HELP[key]
        if kind is bool:
            flag = f"--no-{name}" if default else f"--{name}"
            state = "on by default, this flag turns it off" if default else "off by default"
            parser.add_argument(flag, dest=key, action="store_const", const=not default,
                                help=f"{text}: {state}".replace("%", "%%"))
            continue
        notes = [rules[key].text] if key in rules else []
        if default not in (None, []):
            notes.append(f"default: {default}")
        if notes:
            text += f" ({'; '.join(notes)})"
        choices = typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else None
        parser.add_argument(f"--{name}", dest=key, type=kind if kind in (int, float) else str,
                            choices=choices,
                            metavar=None if choices else name.upper().replace("-", "_"),
                            help=text.replace("%", "%%"))


def config_overrides(args: argparse.Namespace, keys: Sequence[str]) -> list[str]:
    """KEY=VALUE for each of these keys whose flag (add_config_flags) was given."""
    out = []
    for key in keys:
        value = getattr(args, key)
        if value is not None:
            out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out
