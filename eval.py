"""Score a checkpoint on the Sparse-RL paper's math benchmarks through minisparse's engine.

    python eval.py --model PATH --output DIR [--benchmarks gsm8k,math500,...]
                   [--compress rkv|my_rules:MyRule --budget 512 ...] [--config NAME]
    python eval.py --run OUTPUT_DIR [--full] [--no-base]   # a training run's own task

With no other flags it follows the paper's protocol (seven benchmarks, T=0.8, top-p 0.95,
1 sample / 8,192 tokens, 32 samples / 16,384 tokens on aime24 and amc23, "boxed" prompt).
The same checkpoint can be scored dense and with a compressed KV cache (--compress) to
measure how robust it is when served compressed. Model, compression and engine settings
may come from a training config (--config); explicit flags win. Bad benchmarks, files,
rows, models or settings exit with code 2 before any generation. See docs/eval.md.

--run scores a training run's newest complete checkpoint on the run's own task (generated
arithmetic at its difficulty, else its eval benchmarks) with its prompt template, at a
size a CPU finishes in minutes (RUN_LIMIT distinct problems, RUN_SAMPLES samples of up to
the run's max_response_len tokens, its temperature and top_p; --full: the protocol), and
the run's base model (model.path) the same way, once, beside it: a table of the two with
the checkpoint's paired difference from its base, problem by problem (docs/eval.md).
"""
from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C while the libraries below import: one line, no traceback
    from minisparse.utils.interrupt import stop_at_once

    stop_at_once("eval.py: stopped by Ctrl-C while starting; nothing scored yet")

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

from minisparse.config.cli import (ENGINE_KEYS, HelpFormatter, add_config_args,
                                   add_config_flags, config_overrides)
from minisparse.config.load import dump_config, load_config, section_keys
from minisparse.config.schema import Config, ConfigError, EvalConfig
from minisparse.data.benchmarks import BenchmarkError, load_benchmarks, parse_benchmark_names
from minisparse.data.prompts import check_prompt_template
from minisparse.data.synthetic import Difficulty
from minisparse.evaluation.results import ResultsMismatchError
from minisparse.evaluation.scores import format_table
from minisparse.trainer.checkpoint import latest_checkpoint
from minisparse.trainer.run_config import run_config_path
from minisparse.utils.heartbeat import heartbeat
from minisparse.utils.interrupt import CTRL_C_EXIT, ready
from minisparse.utils.user_code import UserCodeError, print_error

# Config keys with a flag; a flag given on the command line becomes a KEY=VALUE override.
MODEL_KEYS = ("model.path", "model.dtype")
ENGINE_FLAG_KEYS = ("engine.backend", *ENGINE_KEYS)
COMPRESS_KEYS = tuple(section_keys("compress"))
# The generated arithmetic's difficulty: --benchmarks arithmetic scores held-out problems
# of the kind a run trained on (data.path synthetic), so a --config's data section counts.
ARITHMETIC_KEYS = ("data.synthetic_max_operand", "data.synthetic_operators",
                   "data.synthetic_operations")
RUN_KEYS = ("seed", "cpu_threads", *MODEL_KEYS, *ENGINE_FLAG_KEYS, *COMPRESS_KEYS,
            *ARITHMETIC_KEYS)
# eval.compress is for evaluation during training; here --compress and its flags decide.
EVAL_KEYS = tuple(k for k in section_keys("eval") if k != "eval.compress")
UNSET = "flags left out keep the --config's value, else the default shown here"
# --run without --full: a quick look that a CPU finishes in minutes, not the protocol.
RUN_LIMIT = 50
RUN_SAMPLES = 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--output", default=None, help="results folder (re-runs skip finished "
                   "benchmarks); default with --run: OUTPUT_DIR/eval/quick/CHECKPOINT "
                   "(--full: eval/full/)")
    r = p.add_argument_group("a training run (instead of --model and --config)")
    r.add_argument("--run", metavar="OUTPUT_DIR", default=None,
                   help="score the run's newest checkpoint on its own task and prompt, "
                        f"{RUN_LIMIT} problems x {RUN_SAMPLES} samples of up to its "
                        "max_response_len tokens, beside its base model")
    r.add_argument("--full", action="store_true",
                   help="with --run: every problem, the protocol's samples and lengths")
    r.add_argument("--no-base", dest="base", action="store_false",
                   help="with --run: do not score the base model")
    p.add_argument("--overwrite", action="store_true", help="redo finished benchmarks")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    g = p.add_argument_group("benchmarks and sampling (default: the paper's protocol)",
                             "these flags or --set eval.KEY=VALUE; a --config's eval section "
                             "(for evaluation during training) is not used")
    add_config_flags(g, EVAL_KEYS)
    g = p.add_argument_group("model, engine and seed", UNSET)
    add_config_flags(g, ("seed", "cpu_threads", *MODEL_KEYS))
    g.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    add_config_flags(g, ENGINE_FLAG_KEYS)
    add_config_flags(p.add_argument_group("KV compression during generation", UNSET),
                     COMPRESS_KEYS)
    add_config_flags(p.add_argument_group("generated arithmetic (--benchmarks arithmetic)",
                                          UNSET), ARITHMETIC_KEYS)
    add_config_args(p)
    return p


def run_checkpoint(run: str) -> tuple[Path, Path]:
    """(the run's recorded config, its newest complete checkpoint); ConfigError naming what
    the folder lacks."""
    config = run_config_path(run)
    if not config.is_file():
        why = ("no such folder" if not Path(run).is_dir() else
               f"no {config.name}: not a training run's output_dir, or one from before runs "
               f"recorded their config (score its checkpoint with --model and --config)")
        raise ConfigError(f"--run {run}: {why}")
    newest = latest_checkpoint(run)
    if newest is None:
        raise ConfigError(f"--run {run}: no complete checkpoint under {run}/checkpoints "
                          f"(a run with save_interval 0 saves none)")
    return config, newest


def run_protocol(cfg: Config, full: bool) -> list[str]:
    """The eval overrides that score a run on its own task: generated arithmetic at its
    difficulty for a synthetic run (else its eval benchmarks, else the paper's), the prompt
    its rows had; without `full`, RUN_LIMIT problems x RUN_SAMPLES samples at its own
    length, temperature and top_p. (Dense unless its in-training eval compressed:
    resolve_settings.)"""
    synthetic = cfg.data.path == "synthetic"
    template = (("user" if cfg.data.apply_chat_template else "boxed") if synthetic
                else cfg.eval.prompt_template)
    benchmarks = "arithmetic" if synthetic else ",".join(cfg.eval.benchmarks)
    evals = [f"eval.prompt_template={template}", f"eval.data_dir={cfg.eval.data_dir}"]
    evals += [f"eval.benchmarks={benchmarks}"] if benchmarks else []
    if not full:
        evals += [f"eval.limit={RUN_LIMIT}", f"eval.n_samples={RUN_SAMPLES}",
                  f"eval.max_new_tokens={cfg.max_response_len}",
                  f"eval.temperature={cfg.temperature}", f"eval.top_p={cfg.top_p}"]
    return evals


def resolve_settings(args: argparse.Namespace) -> tuple[Config, EvalConfig, str | None]:
    """(run config, eval config, the base model to score beside: --run only). The config
    loads once: --config (--run: the run's recorded one, its newest checkpoint as the
    model), then --set, then flags.
    Eval: the schema's protocol (--run: the run's own task, run_protocol), then --set
    eval.*, then flags; a training config's own eval section (its in-training evaluation)
    is not used."""
    config = args.config
    if args.run is not None:
        if args.config is not None or getattr(args, "model.path") is not None:
            raise ConfigError("--run scores the run's own checkpoint with its recorded config; "
                              "leave out --model and --config (or score a checkpoint with "
                              "them, without --run)")
        config, newest = run_checkpoint(args.run)
    if getattr(args, "model.path") is None and config is None:
        raise ConfigError("give --model (or --config with model.path, or --run)")
    cfg = load_config(config, args.overrides + config_overrides(args, RUN_KEYS))
    evals, base = [], None
    if args.run is not None:  # the checkpoint, scored on the run's task; its base beside it
        evals, base = run_protocol(cfg, args.full), cfg.model.path
        cfg = with_model(cfg, str(newest / "hf"))
        if not cfg.eval.compress and not _given(args, "compress.algorithm"):
            cfg = dataclasses.replace(cfg, compress=dataclasses.replace(cfg.compress,
                                                                        algorithm="none"))
    evals += [s for s in args.overrides if s.strip().startswith("eval.")]
    eval_cfg = load_config(None, evals + config_overrides(args, EVAL_KEYS)).eval
    return cfg, dataclasses.replace(
        eval_cfg, benchmarks=parse_benchmark_names(eval_cfg.benchmarks)), base


def with_model(cfg: Config, path: str) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=path))


def _given(args: argparse.Namespace, key: str) -> bool:
    """Whether the command line sets key (its flag, or --set KEY=...)."""
    return (getattr(args, key, None) is not None
            or any(s.split("=", 1)[0].strip() == key for s in args.overrides))


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


def output_folder(args: argparse.Namespace, name: str) -> Path:
    """Where results go: --output, else (--run) OUTPUT_DIR/eval/quick|full/NAME; in-training
    evaluation writes OUTPUT_DIR/eval/rollout_N itself, with its own settings."""
    if name != "base" and args.output is not None:
        return Path(args.output)
    if args.run is None:
        raise ConfigError("give --output DIR (the results folder), or --run OUTPUT_DIR")
    return Path(args.run) / "eval" / ("full" if args.full else "quick") / name


def score(cfg: Config, eval_cfg: EvalConfig, problems: dict, output: Path,
          args: argparse.Namespace) -> dict:
    """Load cfg.model.path, build its rollout backend and evaluate it into `output`: the summary."""
    from minisparse.engine import make_backend
    from minisparse.evaluation.loop import evaluate
    from minisparse.models.loading import load_policy

    device = _device(args.device)
    with heartbeat("load", enabled=args.progress):
        model, tokenizer = load_policy(cfg.model.path, cfg.model.dtype, device)
        check_prompt_template(tokenizer, eval_cfg.prompt_template)  # before the backend
        llm = make_backend(cfg, model, tokenizer, device)
    return evaluate(llm, tokenizer, eval_cfg, output, problems=problems,
                    settings=run_settings(cfg, eval_cfg.benchmarks), seed=cfg.seed,
                    reward=cfg.reward, overwrite=args.overwrite, progress=args.progress)


def base_line(name: str, summary: dict, base: str, base_summary: dict, where: Path) -> str:
    """The checkpoint's average accuracy beside its base model's."""
    return (f"average accuracy: {100 * summary['average_accuracy']:.1f}% for {name}, "
            f"{100 * base_summary['average_accuracy']:.1f}% for the base model {base} "
            f"(its results in {where})")


def run(args: argparse.Namespace) -> int:
    """The settings (the config loaded once), the benchmarks, then the model scored into
    its folder (--run: the run's newest checkpoint, then its base model)."""
    cfg, eval_cfg, base = resolve_settings(args)
    if args.print_config:
        print(dump_config(dataclasses.replace(cfg, eval=eval_cfg)), end="")
        return 0
    from minisparse.compression import check_rule

    check_rule(cfg.compress)  # imported before the benchmarks are read or a model loads
    name = Path(cfg.model.path).parent.name if args.run else "model"
    output = output_folder(args, name)
    level = Difficulty.from_config(cfg.data)
    problems = load_benchmarks(eval_cfg.benchmarks, eval_cfg.data_dir, eval_cfg.limit, level)
    from minisparse.engine import check_backend
    from minisparse.utils.quiet import quiet_libraries

    quiet_libraries(cfg.log.verbose)
    check_backend(cfg)
    if _device(args.device) == "cpu" or cfg.cpu_threads:
        from minisparse.utils.threads import set_threads

        print(set_threads(cfg.cpu_threads).line(), flush=True)
    summary = score(cfg, eval_cfg, problems, output, args)
    print(format_table(summary))
    print(f"results in {output.resolve()}")
    if base is not None and args.base:
        from minisparse.plot.evals import compare_folders

        where = output_folder(args, "base")
        print(base_line(name, summary, base, score(with_model(cfg, base), eval_cfg, problems,
                                                   where, args), where))
        print(compare_folders({"base": where, name: output}))  # with the paired difference
    return 0


def stopped_line(argv: list[str]) -> str:
    """Said on Ctrl-C: benchmarks finished before it keep their results, and the same
    command skips them."""
    return (f"eval.py: stopped by Ctrl-C; benchmarks finished before it keep their results "
            f"and the same command goes on with the rest: python eval.py {shlex.join(argv)}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ConfigError, BenchmarkError, ResultsMismatchError, FileNotFoundError) as exc:
        print(f"eval.py: error: {exc}", file=sys.stderr)
        return 2
    except UserCodeError as exc:  # the user's compression rule failed: one line naming it
        print_error(exc, "eval.py: error")
        return 1
    except KeyboardInterrupt:
        print(stopped_line(sys.argv[1:] if argv is None else argv), file=sys.stderr)
        return CTRL_C_EXIT


if __name__ == "__main__":
    ready()  # from here Ctrl-C is KeyboardInterrupt, which main turns into one line
    sys.exit(main())
