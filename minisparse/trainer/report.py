"""What a run tells the person who started it, besides its per-rollout lines: at start what
it runs (config, model and whether its weights are random, device, rollouts, the rollout
KV cache, where outputs go), at the end where its outputs are and the command that plots
them, and, instead of silently doing nothing, that a finished run is finished and how to
go on. train.py prints these; they are built here so it stays a readable loop.
"""
from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from minisparse.compression.rule import rule_class
from minisparse.compression.trigger import first_compression_len
from minisparse.config.load import load_config, shipped_configs
from minisparse.config.schema import Config, ConfigError
from minisparse.trainer.checkpoint import damage, latest_checkpoint, trainer_state
from minisparse.trainer.run_config import check_same_settings
from minisparse.models.loading import SHAPES


def random_weights(model_path: str) -> bool:
    """Whether model.path names weights that are made up: the tiny model or a shape."""
    return model_path == "tiny" or model_path in SHAPES


def model_line(cfg: Config) -> str:
    path = cfg.model.path
    # random weights get no math answer right; a reward of the user's own may still pay
    stays = ("so its answers stay wrong (reward.function scores them as it will)"
             if cfg.reward.function else "so reward and accuracy stay 0")
    if path == "tiny":
        return (f"model: tiny, {cfg.model.dtype}: random weights built locally, {stays}; "
                f"this run checks that the pipeline works, it does not learn (smollm2_cpu "
                f"learns on a CPU)")
    if path in SHAPES:
        return (f"model: {path} shape, {cfg.model.dtype}: random weights (no checkpoint), "
                f"{stays}; for timing and memory only")
    return f"model: {path}, {cfg.model.dtype}"


def lora_line(cfg: Config) -> list[str]:
    """With model.lora: what trains, in one line (nothing otherwise)."""
    lora = cfg.model.lora
    if not lora.enabled:
        return []
    return [f"LoRA: rank {lora.rank} adapters (alpha {lora.alpha:g}) on "
            f"{', '.join(lora.target_modules)} train, the base stays frozen and is the "
            f"reference; rollouts sample with the merged weights"]


def cache_line(cfg: Config, longest_prompt: int) -> str:
    """The rollout KV cache, and where the first compression falls for the longest prompt."""
    c = cfg.compress
    if c.algorithm == "none":
        return "rollout KV cache: dense (no compression)"
    how = (f"every {c.divide_length} tokens" if c.divide_method == "step_length"
           else "at newlines")
    into = first_compression_len(c, longest_prompt) - 2  # response tokens cached by then
    when = (f"the longest prompt ({longest_prompt} tokens) is compressed once read" if not into
            else f"the first compression comes {into} tokens into a response (longest "
                 f"prompt, {longest_prompt} tokens)")
    kept = (f"the prompt + {c.budget} response tokens kept" if c.keep_prompt
            else f"{c.budget} tokens kept")
    return (f"rollout KV cache: {rule_class(c.algorithm).name}, {kept}, "
            f"compressed {how}; {when}")


def start_report(cfg: Config, config: str, overrides: list[str], device: str,
                 processes: int, start_rollout: int, longest_prompt: int, legend: str,
                 machine: Sequence[str] = ()) -> str:
    """Lines printed once the run is set up, before its first rollout; `machine`: lines
    after the device's (CPU threads, the expected memory peak); the last, `legend`,
    explains the per-rollout line's columns (logger.summary_legend)."""
    source = f"config: {config}"
    if overrides:
        source += f", with {' '.join(overrides)}"
    todo = cfg.num_rollout - start_rollout
    rollouts = (f"rollouts: {todo}, {start_rollout + 1} to {cfg.num_rollout}"
                + (f" (resumed after rollout {start_rollout})" if start_rollout else "")
                + f"; each {cfg.rollout_batch_size} prompts x {cfg.n_samples_per_prompt} "
                  f"samples of up to {cfg.max_response_len} tokens, then "
                  f"{cfg.num_steps_per_rollout} optimizer steps")
    every = "rollout" if cfg.save_interval == 1 else f"{cfg.save_interval} rollouts"
    saves = (f"a checkpoint every {every} and at the end"
             if cfg.save_interval else "no checkpoints (save_interval 0)")
    return "\n".join([
        source,
        model_line(cfg),
        *lora_line(cfg),
        f"device: {device}, {processes} process{'es' if processes > 1 else ''}",
        *machine,
        rollouts,
        cache_line(cfg, longest_prompt),
        f"outputs: {cfg.output_dir} (metrics.jsonl, "
        + ("tensorboard/, " if cfg.log.tensorboard else "") + saves + ")",
        legend,
    ])


def plot_command(output_dir: str) -> str:
    return f"python -m minisparse.plot {output_dir}"


def eval_command(output_dir: str) -> str:
    return f"python eval.py --run {output_dir}"


def end_report(cfg: Config, minutes: float, start_rollout: int = 0) -> str:
    """What this process ran (rollouts after `start_rollout`, the checkpoint it resumed
    from), in how long, where the outputs are and how to look at them."""
    out = Path(cfg.output_dir)
    rollouts = f"{cfg.num_rollout} rollout{'s' if cfg.num_rollout != 1 else ''}"
    if start_rollout:
        ran = cfg.num_rollout - start_rollout
        rollouts = (f"rollouts {start_rollout + 1} to {cfg.num_rollout} ({ran} in this run, "
                    f"resumed after rollout {start_rollout})")
    lines = [f"finished {rollouts} in {minutes:.1f} min; outputs in {out}/:",
             "  metrics.jsonl       one row per rollout"]
    if cfg.log.tensorboard:
        lines.append(f"  tensorboard/        tensorboard --logdir {out / 'tensorboard'}")
    newest = latest_checkpoint(out)
    if newest is not None:
        lines.append(f"  {(newest / 'hf').relative_to(out)}/  the trained model")
    lines.append(f"plot: {plot_command(cfg.output_dir)}  (writes {out / 'curves.png'})")
    if newest is not None:
        lines.append(f"score it: {eval_command(cfg.output_dir)}  (its own task, beside the "
                     f"base model, minutes on a CPU; --full: the whole benchmark)")
    return "\n".join(lines)


def stop_report(cfg: Config, why: str, done: int, dropped: int | None,
                minutes: float) -> str:
    """Said when a stop signal ended training: after rollout `done`, or in rollout
    `dropped` (thrown away before its update; `done` is the one before), with what is
    saved and the command that continues."""
    where = (f"after rollout {done} of {cfg.num_rollout}" if dropped is None else
             f"in rollout {dropped} of {cfg.num_rollout} (dropped before its update; a "
             f"resume redoes it)")
    kept = resume_hint(cfg) if cfg.save_interval else "nothing saved (save_interval 0)"
    return f"stopped by {why} {where} after {minutes:.1f} min; {kept}"


def continue_command(cfg: Config, argv: list[str] | None = None) -> str:
    """The command line this process was started with, as the user would type it again
    (torchrun's when under it, with this node's --node_rank on several nodes): with
    resume=auto (the default) it resumes from the newest checkpoint. A run started with
    resume=never gets resume=auto added, or it would start over."""
    words = list(sys.argv if argv is None else argv)
    if cfg.resume == "never":
        words += ["--set", "resume=auto"]
    launcher = "python"
    if "LOCAL_WORLD_SIZE" in os.environ:  # set by torchrun for its workers
        launcher = f"torchrun --nproc_per_node {os.environ['LOCAL_WORLD_SIZE']}"
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
        if nodes > 1:
            launcher = (f"torchrun --nnodes {nodes} --node_rank {os.environ['GROUP_RANK']} "
                        f"--nproc_per_node {os.environ['LOCAL_WORLD_SIZE']} --master_addr "
                        f"{os.environ['MASTER_ADDR']} --master_port {os.environ['MASTER_PORT']}")
    return f"{launcher} {shlex.join(words)}"


def resume_hint(cfg: Config) -> str:
    """The newest complete checkpoint and the command that continues from it."""
    newest = latest_checkpoint(cfg.output_dir)
    if newest is None:
        return f"nothing saved yet; to start again: {continue_command(cfg)}"
    done = trainer_state(newest)["rollout"]
    return f"saved: {newest} (rollout {done}); to continue from it: {continue_command(cfg)}"


def where(rollout: int | None) -> str:
    return f"in rollout {rollout}" if rollout else "during set-up"


def interrupted_report(cfg: Config, why: str, rollout: int | None,
                       unsaved: str | None = None) -> str:
    """One line for a run a stop signal ended before it could save (during set-up, where
    there is nothing to save, or `unsaved`: what kept it from saving): what is saved and
    the command that continues."""
    stopped = f"stopped by {why} {where(rollout)}"
    if unsaved:
        stopped += f" before it could save ({unsaved})"
    return f"{stopped}; {resume_hint(cfg)}"


def peer_lost_report(cfg: Config, who: str, why: str, rollout: int | None) -> str:
    """One line for a run that stopped because another rank died, froze or failed."""
    return f"error: {who} {why}; the run stopped {where(rollout)}; {resume_hint(cfg)}"


def term_notice() -> str:
    """Said at once when a stop signal comes during an update ({signal}: its name)."""
    return ("{signal} received: the run stops once the update under way has finished; "
            "send it again to stop at once")


def finished_message(cfg: Config) -> str | None:
    """Said instead of starting when output_dir's newest checkpoint already holds every
    rollout this config asks for (a rerun of the same command would otherwise resume,
    find nothing to do and exit silently); None when there is work left, or when the
    newest checkpoint is damaged (sizes checked only: this runs on every launch, and
    resume's pre-flight names the damage and falls back). Raises ConfigError when the
    finished run's settings differ from cfg's: that variant has not run."""
    if cfg.resume == "never":
        return None
    newest = latest_checkpoint(cfg.output_dir)
    if newest is None or damage(newest, hashes=False):
        return None
    done = trainer_state(newest)["rollout"]
    if done < cfg.num_rollout:
        return None
    check_same_settings(cfg)
    held = (f"{done} of {cfg.num_rollout} rollouts" if done == cfg.num_rollout
            else f"{done} rollouts, past the {cfg.num_rollout} this config asks for")
    return (f"{cfg.output_dir} already holds a finished run: {held} (checkpoint {newest}). "
            f"To train on from it, raise num_rollout "
            f"(--set num_rollout={done + cfg.num_rollout}); to start again, give a new "
            f"output_dir (--set output_dir=...). Its curves: {plot_command(cfg.output_dir)}")


def config_menu() -> str:
    """The shipped configs, one line each, for a train.py started without --config."""
    rows = []
    for name in shipped_configs():
        try:
            cfg = load_config(name)
            c = cfg.compress
            cache = ("dense" if c.algorithm == "none"
                     else f"{rule_class(c.algorithm).name} {c.budget}")
        except ConfigError as exc:  # a broken config (or its rule) still gets its line
            rows.append(f"  {name:16} (does not load: {exc})")
            continue
        weights = " (random weights)" if random_weights(cfg.model.path) else ""
        rows.append(f"  {name:16} {cfg.model.path}{weights}, {cache}, {cfg.num_rollout} "
                    f"rollouts of {cfg.rollout_batch_size} x {cfg.n_samples_per_prompt}")
    return "\n".join(rows)


def no_config_message() -> str:
    return ("train.py: error: no --config given. Pick a shipped config (--config NAME) or a "
            "YAML file; to start: tiny_rkv (seconds on any CPU, random weights) or "
            "smollm2_cpu (a real model learning on a CPU, 10-18 minutes):\n"
            + config_menu())
