"""GRPO with sparse (KV-compressed) rollouts: the training loop, top to bottom.

    python train.py --config tiny_rkv                      # any CPU, seconds
    torchrun --nproc_per_node 4 train.py --config qwen3b_rkv

One process per GPU holds a DeepSpeed ZeRO-sharded policy and an in-process rollout
engine that samples with the policy's own weights. Each rollout:

  1. rollout   the engine samples n responses for this rank's prompts (compressed KV);
               grade_batch starts grading them on a thread of its own (math-verify in
               reward.workers processes, each answer stopped at reward.timeout_s)
  2. logprobs  dense log-probs of the current (old) and reference policies, then the
               Sparse-RL correction weights from the sampler/dense mismatch
  3. reward    the grades (or reward.function per response, here), advantages per
               loss.advantage (dynamic_sampling: graded in rounds during 1)
  4. update    num_steps_per_rollout optimizer steps in packed micro-batches
  5. log       metrics.jsonl, TensorBoard (wandb), one console line
  6. save      an HF checkpoint + resume state every save_interval rollouts and at the
               end (save_interval 0: never)

GPU memory changes hands between phases: the engine's KV pool is allocated for the
rollout and released for the update. The training state (fp32 master weights, AdamW
moments, gradients) stays on the GPU through the rollout where the pool beside it still
holds the rollout's sequences, and waits on the CPU otherwise. Before any model loads,
the memory plan (trainer/memory/plan.py) estimates each phase's peak against the GPU,
chooses that, gradient checkpointing, the ZeRO stage, where the optimizer runs and the
micro-batch budgets, and stops with one line a run whose settings cannot fit.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # Ctrl-C while the libraries below import (~2 s): no traceback
    from minisparse.utils.interrupt import stop_at_once

    stop_at_once("stopped by Ctrl-C while starting; nothing saved yet"
                 if os.environ.get("RANK", "0") == "0" else "")

import argparse
import random
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import mean
from typing import Any

import torch

from minisparse.config.cli import (RawEpilogHelpFormatter, add_config_args, config_from_args,
                                   exit_with_error, first_process)
from minisparse.config.load import check_training_config, config_to_dict
from minisparse.config.schema import Config, ConfigError
from minisparse.compression.trigger import check_compression_reach
from minisparse.data.benchmarks import BenchmarkError
from minisparse.data.datasets import DataError, PromptRow, PromptSampler, load_prompts
from minisparse.data.prompts import check_prompt_template
from minisparse.data.reward import launch_grading_processes
from minisparse.engine import RolloutBackend, make_backend
from minisparse.models.flops import FlopShape, batch_forward_flops, flop_shape, mfu_metrics, peak_flops
from minisparse.utils import distributed as dist
from minisparse.utils.distributed import Max, Sum
from minisparse.utils.peers import FINISHED
from minisparse.utils.quiet import quiet_libraries
from minisparse.utils.threads import set_threads
from minisparse.utils.user_code import UserCodeError, print_error
# the machinery that trains a DeepSpeed policy
from minisparse.trainer.batching import step_micro_batches
from minisparse.trainer.checkpoint import (CheckpointError, DiskFullError, resume, rng_state,
                                           save_checkpoint, set_rng_state)
from minisparse.trainer.logger import MetricsLogger, reduce_metrics, summary_legend, summary_line
from minisparse.trainer.logprobs import batch_logprobs, response_logprobs
from minisparse.trainer.measure import phase
from minisparse.trainer.memory.choices import MemoryPlan
from minisparse.trainer.memory.phases import Swaps, rollout_weights
from minisparse.trainer.memory.plan import plan_errors, plan_memory, plan_metrics
from minisparse.trainer.memory.report import comparison_line, cpu_memory_line, plan_table
from minisparse.trainer.policy import Reference, build_policy
from minisparse.trainer.preflight import PreflightError, check_run
from minisparse.trainer.report import (config_menu, end_report, finished_message,
                                       interrupted_report, no_config_message, peer_lost_report,
                                       start_report, stop_report, term_notice)
from minisparse.trainer.run_lock import RunLockError
from minisparse.trainer.stop import NAMES, Interrupted, StopOnSignal
from minisparse.trainer.train_engine import build_train_engine
from minisparse.trainer.update import LossFn, accumulate_and_step, rank_share
# the algorithm: GRPO with the Sparse-RL corrections
from minisparse.grpo.advantages import compute_advantages
from minisparse.grpo.corrections import compute_corrections
from minisparse.grpo.dynamic_sampling import sample_with_signal
from minisparse.grpo.loss import step_denominator
from minisparse.grpo.mismatch import mismatch_metrics
from minisparse.grpo.batch import RolloutBatch, rollout_metrics
from minisparse.grpo.objective import micro_batch_loss
from minisparse.grpo.rewards import set_rewards
# the hand-over: the engine's samples into the algorithm's batch, graded
from minisparse.rollout import (
    BackgroundGrading,
    build_batch,
    generate_metrics,
    grade_responses,
    sampling_params,
    score_batch,
)
from minisparse.evaluation.generate import Shard
from minisparse.evaluation.loop import evaluate
from minisparse.evaluation.scores import flat_metrics

# The console line of each rollout: (column, metric, what it means in plain words, for the
# legend printed once at start).
COLUMNS = (
    ("reward", "rollout/reward_mean", "mean reward"),
    ("acc", "rollout/accuracy", "share answered right"),
    ("len", "rollout/response_len_mean", "mean answer tokens"),
    ("pg", "train/pg_loss", "policy-gradient loss"),
    ("kl", "train/kl", "KL from the reference model"),
    ("gnorm", "train/grad_norm", "gradient norm"),
    ("keep", "rs/kept_token_frac", "share of tokens kept by rejection sampling"),
    ("tok/s", "perf/rollout_tokens_per_s", "sampling speed"),
)


@dataclass
class Run:
    """Everything the loop touches, built once by setup()."""

    cfg: Config
    device: torch.device
    train_engine: Any  # DeepSpeed engine; .module is the HF policy
    swaps: Swaps  # GPU memory between rollout and training, as the plan says
    reference: Reference | None  # the reference policy's log-prob pass (None: no KL term)
    llm: RolloutBackend  # native LLMEngine or SGLang, over the policy's weights
    plan: MemoryPlan  # gradient checkpointing, micro-batch budgets, ZeRO stage, offload
    tokenizer: Any
    rows: list[PromptRow]
    sampler: PromptSampler
    logger: MetricsLogger
    flops: FlopShape | None = None  # the policy's FLOP counts, for perf/*_mfu
    peak: float | None = None  # peak FLOP/s per GPU (None: MFU not logged)
    eval_problems: dict | None = None  # benchmark name -> problems, read at setup
    start_rollout: int = 0  # rollouts already done (from a checkpoint)
    current_rollout: int = 0  # the rollout under way (0: none yet), for a stop's report
    saved_rollout: int = 0  # the newest rollout a checkpoint of this run holds
    nonfinite_steps: int = 0
    data_metrics: dict[str, float] = field(default_factory=dict)  # rows read, left out
    machine: list[str] = field(default_factory=list)  # CPU threads and memory, start lines


def build_parser() -> argparse.ArgumentParser:
    parser = add_config_args(argparse.ArgumentParser(
        description=__doc__.split("\n")[0], epilog=f"shipped configs:\n{config_menu()}",
        formatter_class=RawEpilogHelpFormatter))
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the last complete checkpoint in output_dir "
        "(required to exist; the default resume=auto resumes when one exists)",
    )
    return parser


def parse_args() -> tuple[Config, argparse.Namespace]:
    args = build_parser().parse_args()
    if args.config is None and not args.print_config:
        if first_process():
            print(no_config_message(), file=sys.stderr)
        raise SystemExit(2)
    return config_from_args(args, checks=[check_compression_reach, check_training_config]), args


# Growable allocator segments: the phases hand GPU memory back and forth (KV pool, optimizer
# state, activations of changing micro-batches), and fixed-size segments left ~6 GiB
# reserved but unusable at an update's peak. Set before CUDA starts; a user's value wins.
ALLOCATOR = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def setup(cfg: Config, resume_required: bool) -> Run:
    """Process group, pre-flight checks, memory plan, policy (+ reference), DeepSpeed,
    data, engine, resume, logger."""
    os.environ.setdefault(*ALLOCATOR)
    device = dist.init_distributed(cfg.dist.timeout_s, cfg.dist.peer_timeout_s)
    # torch's CPU threads: chosen on a CPU (or as cpu_threads says), before any work
    threads = set_threads(cfg.cpu_threads) if device.type == "cpu" or cfg.cpu_threads else None
    checked = check_run(cfg, dist.world_size(), resume_required)  # before any model loads
    reference = cfg.loss.kl_coef > 0  # the loss's KL term needs reference log-probs
    # also before any model loads: exits 2 if the settings cannot fit
    plan = plan_memory(cfg, device, dist.world_size(), reference)
    if dist.rank() == 0:
        if plan.setup is not None:  # a CPU run plans nothing, and needs no word on it
            print(plan_table(plan), flush=True)
        plan.save(cfg.output_dir)
    machine = [] if threads is None else [threads.line()]
    if device.type == "cpu" and dist.rank() == 0:  # what a laptop must hold, said first
        machine.append(cpu_memory_line(cfg, plan, dist.world_size(), reference))
    random.seed(cfg.seed + dist.rank())
    torch.manual_seed(cfg.seed + dist.rank())

    if not cfg.reward.function:  # they import math-verify while the model loads
        launch_grading_processes(cfg.reward.workers)
    policy, tokenizer, ref = build_policy(cfg, device, plan, reference)
    if checked.eval_problems is not None:
        check_prompt_template(tokenizer, cfg.eval.prompt_template)
    rows = load_prompts(cfg.data, tokenizer)
    sampler = PromptSampler(len(rows), cfg.rollout_batch_size, cfg.seed, dist.rank(),
                            dist.world_size(), shuffle=cfg.data.shuffle)
    dist.barrier()  # DeepSpeed's first broadcast: every rank's model loaded, however long
    train_engine = build_train_engine(policy, cfg, cfg.num_rollout * cfg.num_steps_per_rollout,
                                      device, plan.zero_stage, plan.cpu_adam)
    start, nonfinite = resume(checked.resume_from, train_engine, sampler)
    logger = MetricsLogger(cfg.output_dir, config_to_dict(cfg), cfg.log.run_name,
                           cfg.log.tensorboard, cfg.log.wandb, cfg.log.wandb_project,
                           enabled=dist.rank() == 0)
    logger.drop_after(start if start else -1)  # from scratch: rollout 0's row is redone too
    swaps = Swaps(train_engine, device, plan.keep_state)
    swaps.first()  # the engine's KV pool is sized from what is free after it
    with rollout_weights(train_engine):
        llm = make_backend(cfg, swaps.sampled_model(), tokenizer, device)
    return Run(cfg=cfg, device=device, train_engine=train_engine, swaps=swaps, reference=ref,
               llm=llm, plan=plan, tokenizer=tokenizer, rows=rows, sampler=sampler,
               logger=logger, flops=flop_shape(policy),
               peak=peak_flops(cfg.log.peak_tflops, device),
               eval_problems=checked.eval_problems, start_rollout=start, saved_rollout=start,
               nonfinite_steps=nonfinite, data_metrics=checked.left_out.metrics(),
               machine=machine)


# ------------------------------------------------------------------------------- phases
# Each phase returns what it makes: the rollout batch with what it added, and its metrics.


def rollout_phase(run: Run, rollout: int) -> tuple[RolloutBatch, dict[str, float]]:
    """This rank's prompts -> n sampled responses each, with the sampler's log-probs;
    with dynamic_sampling, rounds of prompts (graded here) until the batch has signal."""
    cfg, stats = run.cfg, []

    def draw(round_: int) -> RolloutBatch:
        rows = [run.rows[i] for i in run.sampler.next_batch()]
        seed = (cfg.seed * 1_000_003 + rollout * 1_009 + round_ * 7_919) % 2**31
        # each sample seeded by its place in the global batch: the same on any world size
        params = replace(sampling_params(cfg, seed),
                         seed_offset=dist.rank() * len(rows) * cfg.n_samples_per_prompt)
        outputs = run.llm.generate([r.prompt_ids for r in rows], params,
                                   progress=dist.rank() == 0)
        stats.append(run.llm.last_stats)
        return build_batch(outputs, rows)

    with run.swaps.sampling(run.llm):
        if cfg.dynamic_sampling:
            batch, metrics = sample_with_signal(
                draw, lambda b: score_batch(b, run.tokenizer, cfg.reward, cfg.max_response_len),
                cfg.n_samples_per_prompt,
                cfg.rollout_batch_size // dist.world_size(), cfg.dynamic_sampling_max_rounds,
                reduce=dist.all_reduce)
        else:
            batch, metrics = draw(0), {}
    return batch, metrics | generate_metrics(stats)


def start_grading(run: Run, batch: RolloutBatch) -> BackgroundGrading | None:
    """The math grader, started on the rollout's answers to run while the log-probs are
    computed; None where the batch is graded already (dynamic sampling) or a
    reward.function plug-in grades it in the reward phase, on the main thread as ever."""
    if batch.rewards is not None or run.cfg.reward.function:
        return None
    return BackgroundGrading(batch, run.tokenizer, run.cfg.reward)


def reward_phase(run: Run, batch: RolloutBatch,
                 grading: BackgroundGrading | None) -> tuple[RolloutBatch, dict[str, float]]:
    """Rewards (the background grading's, waited for), then advantages (loss.advantage:
    per prompt group and/or over the batch)."""
    cfg = run.cfg
    if batch.rewards is None:  # dynamic sampling grades during the rollout
        graded = grading.result() if grading else grade_responses(batch, run.tokenizer, cfg.reward)
        set_rewards(batch, *graded, cfg.reward, cfg.max_response_len)
    advantages, stats = compute_advantages(
        batch.rewards, cfg.n_samples_per_prompt, batch.response_mask.sum(dim=1), cfg.loss,
        reduce=dist.all_reduce)
    return replace(batch, advantages=advantages), rollout_metrics(batch) | stats


def logprob_phase(run: Run, batch: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
    """Dense old (and reference) log-probs, mismatch metrics, Sparse-RL corrections."""
    cfg, module = run.cfg, run.train_engine.module
    args = (batch.prompts, batch.responses, batch.width, run.plan.logprob_tokens, cfg.temperature,
            cfg.model.logprob_chunk)
    module.eval()
    old_logp, ref_logp = batch_logprobs(module, *args), None
    if run.reference is not None:
        with run.reference.visit() as ref:
            ref_logp = batch_logprobs(ref, *args)
    corr = compute_corrections(old_logp, batch.rollout_logp, batch.response_mask, cfg.loss,
                               reduce=dist.all_reduce)
    metrics = mismatch_metrics(old_logp, batch.rollout_logp, batch.response_mask) | corr.metrics
    return replace(batch, old_logp=old_logp, ref_logp=ref_logp, weights=corr.weights,
                   keep=corr.keep), metrics


def update_phase(run: Run, batch: RolloutBatch) -> dict[str, float]:
    """num_steps_per_rollout optimizer steps; the per-step metrics averaged, the optimizer
    steps' seconds summed, skipped (non-finite) steps counted."""
    cfg, train_engine = run.cfg, run.train_engine
    train_engine.module.train()
    offload = run.swaps.offload if run.plan.optimizer_offload else None  # (memory plan)
    lengths = [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)]
    steps = [accumulate_and_step(train_engine, micro_batches,
                                 grpo_loss_fn(run, batch, micro_batches), offload)
             for micro_batches in step_micro_batches(lengths, cfg.num_steps_per_rollout,
                                                     run.plan.update_tokens)]
    metrics = {key: mean(s[key] for s in steps) for key in steps[0]
               if key not in ("train/step_skipped", "time/optimizer_step_s")}
    return metrics | {
        "time/optimizer_step_s": sum(s["time/optimizer_step_s"] for s in steps),
        "train/nonfinite_steps": Sum(sum(s["train/step_skipped"] for s in steps)),
        "train/step": float(train_engine.global_steps),
    }


def grpo_loss_fn(run: Run, batch: RolloutBatch, micro_batches: list[list[int]]) -> LossFn:
    """The GRPO loss of one optimizer step's micro-batch `rows`: the policy's log-probs of
    them now, at the sampling temperature, against the batch (grpo/objective.py), over the
    step's kept count on all ranks (so the step's micro-batch losses sum to its mean)."""
    cfg, model = run.cfg, run.train_engine.module
    samples = [i for rows in micro_batches for i in rows]
    denominator = rank_share(step_denominator(batch.keep[samples], cfg.loss.aggregation))
    entropy = "grad" if cfg.loss.entropy_coef > 0 else "detached"

    def loss(rows: list[int]):
        logp, ent = response_logprobs(model, [batch.prompts[i] for i in rows],
                                      [batch.responses[i] for i in rows], batch.width,
                                      entropy=entropy, temperature=cfg.temperature,
                                      chunk=cfg.model.logprob_chunk)
        return micro_batch_loss(logp, ent, batch, rows, cfg.loss, denominator)

    return loss


def perf_metrics(run: Run, batch: RolloutBatch, metrics: dict) -> dict[str, float]:
    """Achieved TFLOP/s and MFU of the log-prob passes (old, and reference when there is
    one) and of the update (forward + backward, 3 forwards' worth), see models/flops.py;
    update_fwd_bwd leaves the optimizer steps' time out, as plain HF training loops
    measure it."""
    forward = batch_forward_flops(run.flops, batch.prompts, batch.responses)
    passes = 1 + (run.reference is not None)
    fwd_bwd_s = metrics["time/update_s"] - metrics["time/optimizer_step_s"]
    return {
        **mfu_metrics("logprobs", passes * forward, metrics["time/logprobs_s"], run.peak),
        **mfu_metrics("update", 3 * forward, metrics["time/update_s"], run.peak),
        **mfu_metrics("update_fwd_bwd", 3 * forward, fwd_bwd_s, run.peak),
    }


def eval_phase(run: Run, rollout: int) -> dict[str, float]:
    """Benchmarks of cfg.eval with the current weights, each split over all ranks (the
    evaluation loop eval.py runs too); with a dense cache unless eval.compress. The
    training state leaves the GPU for it even where the plan keeps it there for rollouts,
    so the pool (sized now) gets all the room; the next swap to training brings it back."""
    run.swaps.to_rollout(run.llm, keep_state=False)
    cache = nullcontext() if run.cfg.eval.compress else run.llm.dense()
    with run.swaps.sampling(run.llm), cache:
        summary = evaluate(run.llm, run.tokenizer, run.cfg.eval,
                           Path(run.cfg.output_dir) / "eval" / f"rollout_{rollout:06d}",
                           problems=run.eval_problems, seed=run.cfg.seed,
                           reward=run.cfg.reward, overwrite=True, progress=False,
                           log=lambda _: None,
                           shard=Shard(dist.rank(), dist.world_size(), dist.all_gather_object))
    return flat_metrics(summary)


def before_training_eval(run: Run) -> None:
    """cfg.eval on the starting weights, logged as rollout 0: the curve's first point."""
    metrics: dict[str, float] = {}
    with phase("eval", metrics, run.device):
        metrics |= eval_phase(run, 0)
    metrics = reduce_metrics(metrics)
    run.logger.log(0, metrics)
    if dist.rank() == 0:
        scores = ", ".join(f"{key.split('/')[1]} {100 * value:.1f}%" for key, value in
                           metrics.items() if key.endswith("/accuracy"))
        print(f"before training: {scores} ({metrics.get('time/eval_s', 0):.0f} s)", flush=True)


def save_phase(run: Run, rollout: int) -> None:
    state = {
        "rollout": rollout,
        "step": run.train_engine.global_steps,
        "sampler": run.sampler.state_dict(),
        "nonfinite_steps": run.nonfinite_steps,
        "world_size": dist.world_size(),
    }
    try:
        save_checkpoint(run.cfg.output_dir, rollout, run.train_engine, run.tokenizer, state,
                        keep=run.cfg.save_total_limit)
        run.saved_rollout = rollout
    except DiskFullError as exc:  # exit 1: training failed (2 is for inputs refused at start)
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


# --------------------------------------------------------------------------------- loop


@dataclass
class Stopped:
    """How a stop signal ended training: after rollout `done` (its update finished), or in
    rollout `dropped` (thrown away before its update; done = dropped - 1)."""

    signum: int
    done: int
    dropped: int | None = None


def train(run: Run, signals: StopOnSignal) -> Stopped | None:
    """The rollouts left; None when all ran, else how a stop signal ended them (the state
    of the last completed update saved, so the same command resumes after it)."""
    cfg = run.cfg
    if cfg.eval_before_training and run.start_rollout == 0:
        try:
            with signals.droppable():
                before_training_eval(run)
        except Interrupted as stop:  # nothing trained yet: nothing to save
            return Stopped(stop.signum, 0, dropped=0)
    rollouts = range(run.start_rollout + 1, cfg.num_rollout + 1)
    bar = _progress(rollouts, cfg.num_rollout, enabled=dist.rank() == 0 and sys.stdout.isatty())
    for rollout in bar:
        run.current_rollout = rollout
        start = rollout_start(run)
        steps_done, started = run.train_engine.global_steps, time.perf_counter()
        try:
            with signals.droppable():
                batch, metrics = sample(run, rollout, signals)
                signals.commit()  # past here the update runs on every rank
        except Interrupted as stop:
            return dropped(run, rollout, start, stop.signum, signals)
        with phase("update", metrics, run.device):
            metrics |= update_phase(run, batch)
        run.nonfinite_steps += int(metrics["train/nonfinite_steps"])
        metrics |= perf_metrics(run, batch, metrics)
        metrics |= plan_metrics(run.plan, batch, cfg.num_steps_per_rollout, steps_done)
        metrics |= step_metrics(metrics, time.perf_counter() - started) | run.data_metrics

        metrics = reduce_metrics(metrics)
        metrics |= plan_errors(metrics)  # measured / planned peaks - 1
        if cfg.eval_interval and rollout % cfg.eval_interval == 0:
            metrics |= eval_unless_stopped(run, rollout, signals)
        run.logger.log(rollout, metrics)
        if dist.rank() == 0:
            bar.write(summary_line(rollout, metrics, COLUMNS, cfg.num_rollout))
            if rollout == run.start_rollout + 1 and (line := comparison_line(metrics)):
                bar.write(line)
        stop = run.nonfinite_steps >= max(1, cfg.max_nonfinite_steps)
        signalled = signals.requested()
        if signalled:
            signals.stopping()
        if cfg.save_interval and (
            rollout % cfg.save_interval == 0 or rollout == cfg.num_rollout or stop or signalled
        ):
            with signals.saving_now():
                save_phase(run, rollout)
        if stop:
            raise RuntimeError(
                f"stopping: {run.nonfinite_steps} optimizer steps had a non-finite loss or "
                f"gradient norm (max_nonfinite_steps={cfg.max_nonfinite_steps}); see "
                f"train/nonfinite_steps in {cfg.output_dir}/metrics.jsonl"
            )
        if signalled and rollout < cfg.num_rollout:
            return Stopped(signals.signum or signal.SIGTERM, rollout)
    return None


def sample(run: Run, rollout: int, signals: StopOnSignal) -> tuple[RolloutBatch, dict]:
    """A rollout up to its update: samples, log-probs and rewards, with their metrics (the
    answers are graded while the log-probs run; reward's time is what is left to wait
    for). The memory swaps are not cut by a stop (StopOnSignal.uncut)."""
    metrics: dict[str, float] = {}  # what each phase made, then its time and memory
    with phase("swap_to_rollout", metrics, run.device), signals.uncut():
        run.swaps.to_rollout(run.llm)
    with phase("rollout", metrics, run.device):
        batch, made = rollout_phase(run, rollout)
        metrics |= made
    grading = start_grading(run, batch)  # grades while the next two phases run
    with phase("swap_to_train", metrics, run.device), signals.uncut():
        run.swaps.to_training(run.llm)
    with phase("logprobs", metrics, run.device):
        batch, made = logprob_phase(run, batch)
        metrics |= made
    with phase("reward", metrics, run.device):
        batch, made = reward_phase(run, batch, grading)
        metrics |= made
    return batch, metrics


def rollout_start(run: Run) -> dict[str, Any]:
    """What a rollout changes before its update: the data position and the random state
    (the weights and optimizer change in the update alone)."""
    return {"sampler": run.sampler.state_dict(), "rng": rng_state()}


def dropped(run: Run, rollout: int, start: dict[str, Any], signum: int,
            signals: StopOnSignal) -> Stopped:
    """A stop before rollout `rollout`'s update: back to the rollout's start, which is the
    state after rollout - 1, saved unless a checkpoint holds it already (or none can)."""
    run.sampler.load_state_dict(start["sampler"])
    set_rng_state(start["rng"])
    done = rollout - 1
    if not run.cfg.save_interval or done <= run.saved_rollout:
        return Stopped(signum, done, dropped=rollout)
    with signals.saving_now():
        run.swaps.back_to_training(run.llm)  # the optimizer state where a save expects it
        save_phase(run, done)
    return Stopped(signum, done, dropped=rollout)


def eval_unless_stopped(run: Run, rollout: int, signals: StopOnSignal) -> dict[str, float]:
    """eval_phase's metrics; none when a stop drops the evaluation (the update before it
    is kept and saved)."""
    metrics: dict[str, float] = {}
    try:
        with signals.droppable(), phase("eval", metrics, run.device):
            metrics |= eval_phase(run, rollout)
    except Interrupted:
        return {}
    return metrics


def step_metrics(metrics: dict, seconds: float) -> dict[str, float]:
    """A rollout's cost as a whole: wall time from the swap to the rollout to the end of
    the update (evaluation and saving left out) and the most GPU memory any of its phases
    held (mem/peak_gib; GPU only)."""
    peaks = [v for k, v in metrics.items() if k.startswith("mem/") and k.endswith("_peak_gib")]
    out = {"time/step_s": seconds}
    if peaks:
        out["mem/peak_gib"] = Max(max(peaks))
    return out


def _progress(iterable, total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        iterable,
        total=total,
        initial=iterable.start - 1,
        disable=not enabled,
        desc="rollouts",
        dynamic_ncols=True,
        file=sys.stdout,
    )


def main() -> None:
    cfg, args = parse_args()
    quiet_libraries(cfg.log.verbose)
    try:
        finished = finished_message(cfg)
    except ConfigError as exc:  # the folder's finished run trained other settings
        exit_with_error(str(exc))
    if finished:
        if first_process():
            print(finished)
        return
    started = time.perf_counter()
    # from here SIGTERM and Ctrl-C stop set-up at once; training: see trainer/stop.py
    signals = StopOnSignal(speak=first_process())
    run: Run | None = None

    def rollout() -> int | None:
        return run.current_rollout if run is not None else None

    # the lines of a run that cannot go on: a rank lost (dist.peer_timeout_s), or a stop
    # that could not save in time; said from another thread, the process then ends
    dist.on_peer_lost(lambda loss: dist.exit_now(
        peer_lost_report(cfg, loss.who(), loss.why, rollout()), 1, dist.speaks_after(loss)))
    signals.stuck_line = lambda signum, why: interrupted_report(cfg, NAMES[signum], rollout(),
                                                                why)
    left = FINISHED
    try:
        run = setup_and_report(cfg, args)
        signals.training(term_notice())
        stopped = train(run, signals)
        if dist.rank() == 0:
            minutes = (time.perf_counter() - started) / 60
            print(end_report(cfg, minutes, run.start_rollout) if stopped is None else
                  stop_report(cfg, NAMES[stopped.signum], stopped.done, stopped.dropped,
                              minutes), flush=True)
        if stopped is not None and stopped.signum != signal.SIGTERM:
            raise SystemExit(128 + stopped.signum)  # a Ctrl-C: 130, as a shell reports one
    except UserCodeError as exc:  # the user's rule or reward failed: one line naming it
        print_error(exc, verbose=cfg.log.verbose)
        left = f"stopped with an error ({exc})"
        raise SystemExit(1) from None
    except Interrupted as exc:  # set-up: nothing to save yet
        if signals.speak:
            print(interrupted_report(cfg, NAMES[exc.signum], rollout()), flush=True)
        raise SystemExit(128 + exc.signum) from None
    except SystemExit as exc:  # said already; exit 2: the same input error on every rank
        if exc.code not in (None, 0, 2) and not (isinstance(exc.code, int) and exc.code > 128):
            left = f"stopped with an error (exit {exc.code}; its output says why)"
        raise
    except BaseException as exc:
        if signals.signum is not None and dist.broken_collective(exc):  # a stop's doing
            if signals.speak:
                print(interrupted_report(cfg, NAMES[signals.signum], rollout(), "a collective "
                                         "failed as the ranks stopped"), flush=True)
            raise SystemExit(128 + signals.signum) from None
        dist.blame_peer(exc)  # a collective a dead peer broke: its line instead, and exit
        left = f"stopped with an error ({type(exc).__name__}: {str(exc)[:200]})"
        raise
    finally:
        dist.leave(left)
        signals.close()
        if run is not None:
            run.logger.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def setup_and_report(cfg: Config, args: argparse.Namespace) -> Run:
    """setup(), its input errors as one line and exit 2, then the start report."""
    try:
        run = setup(cfg, resume_required=args.resume)
    except (ConfigError, DataError, BenchmarkError, CheckpointError, PreflightError,
            RunLockError, FileNotFoundError) as exc:
        exit_with_error(str(exc))
    if dist.rank() == 0:
        longest = max(len(r.prompt_ids) for r in run.rows)
        print(start_report(cfg, args.config, args.overrides, str(run.device),
                           dist.world_size(), run.start_rollout, longest,
                           summary_legend(COLUMNS), run.machine), flush=True)
    return run


if __name__ == "__main__":
    main()
