"""Score a checkpoint on the Sparse-RL paper's math benchmarks through minisparse's engine.

    python eval.py --model PATH --output DIR [--benchmarks gsm8k,math500,...]
                   [--compress rkv --budget 512 ...] [--config NAME]

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

from minisparse.data.benchmarks import BenchmarkError, load_benchmarks, parse_benchmark_names
from minisparse.config.schema import (
    Algorithm, Backend, Config, ConfigError, DivideMethod, Dtype, EvalConfig, GroupPooling, Pooling,
    PromptTemplate, Selection, choices,
)
from minisparse.config.cli import add_config_args
from minisparse.config.load import dump_config, load_config

# flag dest -> config key; a flag given on the command line becomes a KEY=VALUE override.
RUN_FLAGS = {
    "model": "model.path", "dtype": "model.dtype", "seed": "seed",
    "compress": "compress.algorithm", "budget": "compress.budget",
    "window": "compress.window", "divide_method": "compress.divide_method",
    "divide_length": "compress.divide_length", "max_buffer": "compress.max_buffer",
    "kernel_size": "compress.kernel_size", "pooling": "compress.pooling",
    "group_pooling": "compress.group_pooling", "mix_lambda": "compress.mix_lambda",
    "sim_threshold": "compress.sim_threshold", "selection": "compress.selection",
    "backend": "engine.backend", "page_size": "engine.page_size", "kv_memory_gb": "engine.kv_memory_gb",
    "kv_memory_fraction": "engine.kv_memory_fraction",
    "kv_cpu_memory_gb": "engine.kv_cpu_memory_gb", "max_num_seqs": "engine.max_num_seqs",
    "max_prefill_tokens": "engine.max_prefill_tokens", "cuda_graphs": "engine.cuda_graphs",
}
EVAL_FLAGS = {
    "data_dir": "eval.data_dir", "limit": "eval.limit", "max_new_tokens": "eval.max_new_tokens",
    "temperature": "eval.temperature", "top_p": "eval.top_p", "n_samples": "eval.n_samples",
    "prompt_template": "eval.prompt_template",
}


def _add_protocol_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmarks and sampling (default: the paper's protocol)")
    g.add_argument("--benchmarks", default=None,
                   help="comma-separated; default: gsm8k,math500,minerva_math,olympiadbench,"
                        "aime24,amc23,gaokao2023en")
    g.add_argument("--data-dir", help=f"folder with NAME/test.jsonl (default "
                                      f"{EvalConfig.data_dir}; see docs/eval.md)")
    g.add_argument("--limit", type=int, help="first N problems of each benchmark")
    g.add_argument("--max-new-tokens", type=int,
                   help="for every benchmark (default: 8192; 16384 on aime24, amc23)")
    g.add_argument("--n-samples", type=int,
                   help="samples per problem for every benchmark (default: 1; 32 on aime24, amc23)")
    g.add_argument("--temperature", type=float, help=f"default {EvalConfig.temperature}")
    g.add_argument("--top-p", type=float, help=f"default {EvalConfig.top_p}")
    g.add_argument("--seed", type=int, help=f"sampling seed (default: the config's, {Config.seed})")
    g.add_argument("--prompt-template", choices=choices(PromptTemplate),
                   help="boxed (default): question + instruction, no chat template; "
                        "chat: the training set's system/user turn in the chat template; "
                        "user: one user turn as data.path=synthetic renders it (arithmetic)")


def _add_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", help="HF checkpoint dir, 'tiny', or a shape name (qwen2.5-3b, "
                                   "random weights); default: the --config's model.path")
    g.add_argument("--dtype", choices=choices(Dtype))
    g.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    g.add_argument("--backend", choices=choices(Backend),
                   help="rollout engine; sglang (embedded sglang.Engine) is dense only")
    g.add_argument("--max-num-seqs", "--batch-size", dest="max_num_seqs", type=int,
                   help="sequences decoded at once")
    g.add_argument("--kv-memory-gb", type=float, help="KV pool size in GiB (> 0 wins)")
    g.add_argument("--kv-memory-fraction", type=float, help="else this share of free GPU memory")
    g.add_argument("--kv-cpu-memory-gb", type=float, help="KV pool budget on CPU")
    g.add_argument("--page-size", type=int)
    g.add_argument("--max-prefill-tokens", type=int)
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_const", const=False)


def _add_compress_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV compression during generation (default: none, dense)")
    g.add_argument("--compress", choices=choices(Algorithm))
    g.add_argument("--budget", type=int, help="KV tokens kept per sequence after compression")
    g.add_argument("--window", type=int, help="recent tokens whose queries score the cache")
    g.add_argument("--divide-method", choices=choices(DivideMethod))
    g.add_argument("--divide-length", type=int, help="tokens between compressions")
    g.add_argument("--max-buffer", type=int, help="newline trigger's hard cap")
    g.add_argument("--kernel-size", type=int)
    g.add_argument("--pooling", choices=choices(Pooling))
    g.add_argument("--group-pooling", choices=choices(GroupPooling))
    g.add_argument("--mix-lambda", type=float)
    g.add_argument("--sim-threshold", type=float)
    g.add_argument("--selection", choices=choices(Selection))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--output", required=True, help="results folder (re-runs skip finished "
                                                   "benchmarks)")
    p.add_argument("--overwrite", action="store_true", help="redo finished benchmarks")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    _add_protocol_args(p)
    _add_run_args(p)
    _add_compress_args(p)
    add_config_args(p)
    return p


def _overrides(args: argparse.Namespace, flags: dict[str, str]) -> list[str]:
    out = []
    for dest, key in flags.items():
        value = getattr(args, dest)
        if value is not None:
            out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


def resolve_settings(args: argparse.Namespace) -> tuple[Config, EvalConfig]:
    """(run config, eval config). Model/compress/engine: --config, then --set, then flags.
    Eval: the schema's protocol defaults, then --set eval.*, then flags; a training config's
    own eval section (its in-training evaluation) is not used."""
    if args.model is None and args.config is None:
        raise ConfigError("give --model (or --config with model.path)")
    sets = list(args.overrides)
    cfg = load_config(args.config, sets + _overrides(args, RUN_FLAGS))
    eval_overrides = [s for s in sets if s.strip().startswith("eval.")]
    eval_overrides += _overrides(args, EVAL_FLAGS)
    eval_cfg = load_config(None, eval_overrides).eval
    given = {s.split("=", 1)[0].strip() for s in eval_overrides}
    eval_cfg = dataclasses.replace(
        eval_cfg,
        benchmarks=parse_benchmark_names(args.benchmarks or eval_cfg.benchmarks),
        n_samples=eval_cfg.n_samples if "eval.n_samples" in given else None,
        max_new_tokens=eval_cfg.max_new_tokens if "eval.max_new_tokens" in given else None,
    )
    return cfg, eval_cfg


def run_settings(cfg: Config) -> dict:
    """What the results depend on besides sampling: recorded and checked on re-runs."""
    compress = dataclasses.asdict(cfg.compress)
    if cfg.compress.algorithm == "none":
        compress = {"algorithm": "none"}
    return {"model": cfg.model.path, "dtype": cfg.model.dtype, "compress": compress}


def _device(name: str | None) -> str:
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def run(args: argparse.Namespace) -> int:
    cfg, eval_cfg = resolve_settings(args)
    if args.print_config:
        print(dump_config(dataclasses.replace(cfg, eval=eval_cfg)), end="")
        return 0
    problems = load_benchmarks(eval_cfg.benchmarks, eval_cfg.data_dir, eval_cfg.limit)
    from minisparse.engine import check_backend, make_backend
    from minisparse.evaluation import check_prompt_template, evaluate, format_table
    from minisparse.models.loading import load_policy

    check_backend(cfg)
    device = _device(args.device)
    model, tokenizer = load_policy(cfg.model.path, cfg.model.dtype, device)
    check_prompt_template(tokenizer, eval_cfg.prompt_template)
    engine = make_backend(cfg, model, tokenizer, device)
    summary = evaluate(engine, tokenizer, eval_cfg, args.output, settings=run_settings(cfg),
                       seed=cfg.seed, overwrite=args.overwrite, progress=args.progress,
                       problems=problems)
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
