"""The config flags train.py and eval.py share: --config, --set, --print-config."""
from __future__ import annotations

import argparse
import sys

from minisparse.config.schema import Config, ConfigError
from minisparse.config.load import dump_config, load_config


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


def config_from_args(args: argparse.Namespace) -> Config:
    """Resolved Config; exits 2 with 'config error: ...' on a bad config, 0 after printing."""
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.print_config:
        print(dump_config(cfg), end="")
        raise SystemExit(0)
    return cfg
