"""Score a checkpoint on the Sparse-RL paper's math benchmarks through minisparse's engine.

    python eval.py --model PATH --output DIR [--benchmarks gsm8k,math500,...]
                   [--compress rkv|my_rules:MyRule --budget 512 ...] [--config NAME]

With no other flags it follows the paper's protocol (seven benchmarks, T=0.8, top-p 0.95,
1 sample / 8,192 tokens, 32 samples / 16,384 tokens on aime24 and amc23, "boxed" prompt).
The same checkpoint can be scored dense and with a compressed KV cache (--compress) to
measure how robust it is when served compressed. Model, compression and engine settings
may come from a training config (--config); explicit flags win. Bad benchmarks, files,
rows, models or settings exit with code 2 before any generation. See docs/eval.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from minisparse.config.cli import (ENGINE_KEYS, HelpFormatter, add_config_args,
                                   add_config_flags, config_overrides)
from minisparse.config.load import dump_config, load_config, section_keys
from minisparse.config.schema import Config, ConfigError, EvalConfig
from minisparse.data.benchmarks import BenchmarkError, load_benchmarks, parse_benchmark_names
from minisparse.data.synthetic import Difficulty

# Config keys with a flag; a flag given on the command line becomes a KEY=VALUE override.
MODEL_KEYS = ("model.path", "model.dtype")
ENGINE_FLAG_KEYS = ("engine.backend", *ENGINE_KEYS)
COMPRESS_KEYS = tuple(section_keys("compress"))
# The generated arithmetic's difficulty: --benchmarks arithmetic scores held-out problems
# of the kind a run trained on (data.path synthetic), so a --config's data section counts.
ARITHMETIC_KEYS = ("data.synthetic_max_operand", "data.synthetic_operators",
                   "data.synthetic_operations")
RUN_KEYS = ("seed", *MODEL_KEYS, *ENGINE_FLAG_KEYS, *COMPRESS_KEYS, *ARITHMETIC_KEYS)
# eval.compress is for evaluation during training; here --compress and its flags decide.
EVAL_KEYS = tuple(k for k in section_keys("eval") if k != "eval.compress")
UNSET = "flags left out keep the --config's value, else the default shown here"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--output", required=True, help="results folder (re-runs skip finished "
                                                   "benchmarks)")
    p.add_argument("--overwrite", action="store_true", help="redo finished benchmarks")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    g = p.add_argument_group("benchmarks and sampling (default: the paper's protocol)",
                             "these flags or --set eval.KEY=VALUE; a --config's eval section "
                             "(for evaluation during training) is not used")
    add_config_flags(g, EVAL_KEYS)
    g = p.add_argument_group("model, engine and seed", UNSET)
    add_config_flags(g, ("seed", *MODEL_KEYS))
    g.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    add_config_flags(g, ENGINE_FLAG_KEYS)
    add_config_flags(p.add_argument_group("KV compression during generation", UNSET),
                     COMPRESS_KEYS)
    add_config_flags(p.add_argument_group("generated arithmetic (--benchmarks arithmetic)",
                                          UNSET), ARITHMETIC_KEYS)
    add_config_args(p)
    return p


def resolve_settings(args: argparse.Namespace) -> tuple[Config, EvalConfig]:
    """(run config, eval config). Model/compress/engine: --config, then --set, then flags.
    Eval: the schema's protocol defaults, then --set eval.*, then flags; a training config's
    own eval section (its in-training evaluation) is not used."""
    if getattr(args, "model.path") is None and args.config is None:
        raise ConfigError("give --model (or --config with model.path)")
    sets = list(args.overrides)
    cfg = load_config(args.config, sets + config_overrides(args, RUN_KEYS))
    eval_overrides = [s for s in sets if s.strip().startswith("eval.")]
    eval_overrides += config_overrides(args, EVAL_KEYS)
    eval_cfg = load_config(None, eval_overrides).eval
    given = {s.split("=", 1)[0].strip() for s in eval_overrides}
    eval_cfg = dataclasses.replace(
        eval_cfg,
        benchmarks=parse_benchmark_names(eval_cfg.benchmarks),
        n_samples=eval_cfg.n_samples if "eval.n_samples" in given else None,
        max_new_tokens=eval_cfg.max_new_tokens if "eval.max_new_tokens" in given else None,
    )
    return cfg, eval_cfg


def run_settings(cfg: Config, benchmarks: list[str] = ()) -> dict:
    """What the results depend on besides sampling: recorded and checked on re-runs. The
    arithmetic difficulty is recorded when it is scored at another than the default (so
    results made before it could be set still match)."""
    compress = dataclasses.asdict(cfg.compress)
    if cfg.compress.algorithm == "none":
        compress = {"algorithm": "none"}
    settings = {"model": cfg.model.path, "dtype": cfg.model.dtype, "compress": compress}
    level = Difficulty.from_config(cfg.data)
    if "arithmetic" in benchmarks and level != Difficulty():
        settings["arithmetic"] = dataclasses.asdict(level)
    return settings


def _device(name: str | None) -> str:
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def run(args: argparse.Namespace) -> int:
    cfg, eval_cfg = resolve_settings(args)
    if args.print_config:
        print(dump_config(dataclasses.replace(cfg, eval=eval_cfg)), end="")
        return 0
    from minisparse.compression import check_rule

    check_rule(cfg.compress)  # imported before the benchmarks are read or a model loads
    level = Difficulty.from_config(cfg.data)
    problems = load_benchmarks(eval_cfg.benchmarks, eval_cfg.data_dir, eval_cfg.limit, level)
    from minisparse.engine import check_backend, make_backend
    from minisparse.evaluation import check_prompt_template, evaluate, format_table
    from minisparse.models.loading import load_policy
    from minisparse.quiet import quiet_libraries

    quiet_libraries(cfg.log.verbose)
    check_backend(cfg)
    device = _device(args.device)
    model, tokenizer = load_policy(cfg.model.path, cfg.model.dtype, device)
    check_prompt_template(tokenizer, eval_cfg.prompt_template)
    engine = make_backend(cfg, model, tokenizer, device)
    settings = run_settings(cfg, eval_cfg.benchmarks)
    summary = evaluate(engine, tokenizer, eval_cfg, args.output, settings=settings,
                       seed=cfg.seed, overwrite=args.overwrite, progress=args.progress,
                       problems=problems, reward=cfg.reward)
    print(format_table(summary))
    print(f"results in {Path(args.output).resolve()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from minisparse.evaluation import ResultsMismatchError

    try:
        return run(args)
    except (ConfigError, BenchmarkError, ResultsMismatchError, FileNotFoundError) as exc:
        print(f"eval.py: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
