"""The memory plan, made before the first rollout: each phase's peak GPU memory
(estimate.py) against the GPU's, the settings chosen where they are `auto`, and
a one-line stop (exit 2) where settings a user fixed cannot fit.

It decides:
* gradient checkpointing (model.gradient_checkpointing: auto): off when the update fits
  without it, else on the fewest decoder layers (the first ones) with which it fits:
  each layer left out of it saves recomputing its forward in the backward (true: every
  layer);
* whether AdamW moments and fp32 master weights wait on the CPU during the update's
  forward and backward passes (optimizer_offload: auto), only when nothing else fits:
  they come back for each optimizer step, which needs them on the GPU;
* whether the optimizer's state and step move to the CPU (optimizer_offload: auto ->
  cpu_adam, DeepSpeed ZeRO-Offload's CPU Adam) where even so the update cannot fit on the
  GPU (the step alone needs 16P/N beside the weights): the GPU then keeps the bf16
  weights (and under ZeRO 1 the gradients), the host 20P/N (checked against the host's
  memory available at start, for every rank on it), and the plan's first line says why.
  zero_stage=auto then takes ZeRO 1 wherever it fits: it copies the gradients to the CPU
  once a step, ZeRO 2 after every micro-batch (4P bytes over PCIe each);
* whether the training state (fp32 master weights, AdamW moments, gradient partition)
  stays on the GPU through rollouts: when the KV pool beside it still holds every
  sequence of a rollout at its largest cache (compressed rollouts need little), so the
  swaps between phases move nothing; otherwise it waits on the CPU during rollouts;
* the log-prob passes' micro-batch budget: logprob_max_tokens_per_gpu (auto: at least
  16,384 tokens), less where those passes would not fit. The update's micro-batches keep
  max_tokens_per_gpu; a sequence longer than it gets a micro-batch of its own
  (batching.pack_by_tokens), and the plan counts that one;
* the ZeRO stage (zero_stage: auto): 1 where its plan gives up nothing of ZeRO 2's (the
  same or fewer checkpointed layers, no optimizer offload that 2 avoids, the training
  state kept through rollouts where 2 keeps it, the same log-prob micro-batches), else 2.
  ZeRO 1 reduces gradients across GPUs once a step instead of after every micro-batch
  (faster updates: docs/training.md) but holds every gradient on each GPU.

It plans against the memory free on the GPU at start (gpu_memory_gb, when set, caps it;
without a GPU only gpu_memory_gb makes a plan) less HEADROOM, which the estimates leave
out: the CUDA context and library workspaces, and the caching allocator's fragmentation.
After each rollout the planned peaks of that rollout's batch are logged beside the
measured ones (memory_plan/<phase>_gib, memory_plan/<phase>_error).
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from minisparse.config.schema import Config, ConfigError
from minisparse.trainer.batching import pack_by_tokens, step_micro_batches
from minisparse.trainer.memory import report
from minisparse.trainer.memory.choices import (PHASES, MemoryPlan, Option, allowed_options,
                                               best_peak, largest, option_peak, round_down)
from minisparse.trainer.memory.estimate import (GIB, Setup, all_or_none, backward_peak,
                                                host_memory, kv_tokens, logprob_budget,
                                                logprob_peak, rollout_kv_need, rollout_peak,
                                                setup_of, shape_of, step_peak, update_peak)
from minisparse.trainer.train_engine import cpu_adam_of, zero_stage_of
from minisparse.utils.distributed import Max, all_reduce

# GPU memory in use by other processes at start worth naming (a CUDA context is ~0.5 GiB)
ELSEWHERE = 2 * GIB


def plan_memory(cfg: Config, device: torch.device, world: int, reference: bool) -> MemoryPlan:
    """The run's plan, made before the model loads (ConfigError when it cannot fit);
    reference: the loss needs a reference policy's log-probs."""
    from minisparse.models.liger import liger_applies
    from minisparse.models.loading import model_config

    found = gpu_capacity(cfg, device)
    if found is None:
        return _buildable(not_planned(cfg))
    capacity, name = found
    cap_gpu_memory(cfg, device)
    host = host_available()
    if world > 1:  # every rank plans for the fullest GPU (and host), so all decide the same
        capacity = int(all_reduce(torch.tensor([capacity], dtype=torch.float64), "min").item())
        host = int(all_reduce(torch.tensor([host], dtype=torch.float64), "min").item())
    config = model_config(cfg.model.path)
    liger = liger_applies(cfg.model.liger_kernel, config.model_type, device.type == "cuda")
    setup = setup_of(cfg, shape_of(config), world, liger, reference)
    return _buildable(plan_zero_stage(cfg, setup, capacity, name, host=host))


def _buildable(plan: MemoryPlan) -> MemoryPlan:
    """A plan with CPU Adam stops here (before any model loads) where its op cannot build."""
    from minisparse.trainer.train_engine import cpu_adam_missing

    missing = cpu_adam_missing() if plan.cpu_adam else ""
    if missing:
        raise ConfigError(report.cpu_adam_build_error(plan.cpu_adam_note, missing))
    return plan


def cap_gpu_memory(cfg: Config, device: torch.device) -> None:
    """gpu_memory_gb on a GPU: the caching allocator may hold no more than that (torch's
    per-process memory fraction), so a phase the plan undercounts fails with an
    out-of-memory error rather than quietly using the rest of a larger GPU. (The CUDA
    context and NCCL's buffers are outside the allocator, as HEADROOM assumes.)"""
    if device.type != "cuda" or not cfg.gpu_memory_gb:
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.gpu_memory_gb * GIB / total), device)


def host_available() -> int:
    """Bytes of host memory one rank may count on: MemAvailable (or MINISPARSE_HOST_MEMORY_GB,
    GiB, where the host's memory grows as it is used: a VM whose MemTotal starts small) over
    the ranks on this host (LOCAL_WORLD_SIZE, as torchrun sets it); 0 where it cannot be
    read (not checked)."""
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if os.environ.get("MINISPARSE_HOST_MEMORY_GB"):
        return int(float(os.environ["MINISPARSE_HOST_MEMORY_GB"]) * GIB) // ranks
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0
    return kib * 1024 // ranks


def gpu_capacity(cfg: Config, device: torch.device) -> tuple[int, str] | None:
    """(bytes the plan is for, the device's name), None when there is nothing to plan for."""
    setting = int(cfg.gpu_memory_gb * GIB)
    if device.type != "cuda":
        return (setting, f"gpu_memory_gb={cfg.gpu_memory_gb:g}") if setting else None
    free, total = torch.cuda.mem_get_info(device)
    capacity = free + torch.cuda.memory_reserved(device)
    name = torch.cuda.get_device_name(device)
    if total - capacity > ELSEWHERE:  # a planned run sized for less, and says why
        name += f" ({report.gib(total - capacity)} of its {report.gib(total)} GiB in use elsewhere)"
    if setting:
        capacity = min(capacity, setting)
    return capacity, name


def _fewest_checkpointed(s: Setup, tokens: int, option: Option, usable: int) -> int | None:
    """The fewest layers under gradient checkpointing with which the update fits."""
    return next((n for n in range(s.shape.layers + 1)
                 if update_peak(s, tokens, n, option.offload) <= usable), None)


def not_planned(cfg: Config) -> MemoryPlan:
    return MemoryPlan(gradient_checkpointing=cfg.model.gradient_checkpointing == "true",
                      optimizer_offload=cfg.optimizer_offload == "true",
                      cpu_adam=cpu_adam_of(cfg),
                      logprob_tokens=logprob_budget(cfg, planned=False),
                      update_tokens=cfg.max_tokens_per_gpu,
                      zero_stage=zero_stage_of(cfg))


def plan_zero_stage(cfg: Config, s: Setup, capacity: int, device: str,
                    host: int = 0) -> MemoryPlan:
    """make_plan at the ZeRO stage set; under zero_stage=auto, ZeRO 1's plan where it
    gives up nothing of ZeRO 2's (_zero_1_cost), else ZeRO 2's."""
    if cfg.zero_stage != "auto":
        return make_plan(cfg, s, capacity, device, host)
    two = make_plan(cfg, replace(s, zero_stage=2), capacity, device, host)
    try:
        one = make_plan(cfg, replace(s, zero_stage=1), capacity, device, host)
    except ConfigError:  # ZeRO 2 holds less: fits where 1 may not
        one = None
    if two.cpu_adam:  # ZeRO 2 would move the gradients over PCIe after every micro-batch
        if one is None or not one.cpu_adam:
            two.zero_note = "auto: with CPU Adam ZeRO 1 would not fit"
            return two
        one.zero_note = ("auto: with CPU Adam it moves the gradients to the CPU once a step, "
                         "ZeRO 2 after every micro-batch")
        return one
    cost = _zero_1_cost(one, two)
    chosen = two if cost else one
    chosen.zero_note = (f"auto: ZeRO 1 would {cost}" if cost else
                        "auto: it fits as ZeRO 2 would, with one gradient reduction a step")
    return chosen


def _zero_1_cost(one: MemoryPlan | None, two: MemoryPlan) -> str:
    """What ZeRO 1's plan gives up against ZeRO 2's, in words; "" when nothing. (A plan
    make_plan made counts its checkpointed layers: 0 when checkpointing is off.)"""
    if one is None:
        return "not fit"
    if one.cpu_adam and not two.cpu_adam:
        return "need the optimizer on the CPU"
    if one.optimizer_offload and not two.optimizer_offload:
        return "need the optimizer state on the CPU during the update"
    more = one.checkpointed_layers - two.checkpointed_layers
    if more > 0:
        return f"checkpoint {more} more layer{'s' if more > 1 else ''}"
    if two.keep_state and not one.keep_state:
        return "move the training state off the GPU for rollouts"
    if one.logprob_tokens < two.logprob_tokens:
        return f"cut log-prob micro-batches to {one.logprob_tokens:,} tokens"
    return ""


def make_plan(cfg: Config, s: Setup, capacity: int, device: str, host: int = 0) -> MemoryPlan:
    """The plan for setup s on a GPU of `capacity` bytes (and `host` bytes of host memory
    for this rank, 0: not checked); ConfigError (one line naming the setting and what
    would fit) when the fixed settings cannot fit."""
    if s.cpu_adam and s.zero_stage not in (1, 2):
        raise ConfigError(report.cpu_adam_stage_error(cfg))
    plan = MemoryPlan(False, False, s.max_tokens, s.max_tokens, s, capacity, device,
                      zero_stage=s.zero_stage, cpu_adam=s.cpu_adam, host=host)
    if s.cpu_adam:
        plan.cpu_adam_note = "optimizer_offload=cpu_adam"
        _check_host(s, host)
    usable = plan.usable
    worst = s.worst_tokens
    need = rollout_peak(s, capacity)
    if s.kv_memory and need > usable:  # (a share of the free memory always fits)
        raise ConfigError(report.kv_memory_error(cfg, need, usable))
    plan.keep_state = keeps_state(s, capacity, usable)
    need = rollout_peak(s, capacity, plan.keep_state)
    plan.logprob_tokens = _logprob_budget(cfg, s, usable)
    options = allowed_options(cfg, s)
    chosen = next((o for o in options if option_peak(s, worst, o) <= usable), None)
    if chosen is None and cfg.optimizer_offload == "auto" and s.zero_stage in (1, 2) \
            and not s.cpu_adam:
        try:  # the optimizer's state and step to the CPU: what is left to try
            cpu = make_plan(cfg, replace(s, cpu_adam=True), capacity, device, host)
        except ConfigError as error:
            gpu = report.update_error(cfg, s, usable, capacity)
            if "host memory" in str(error):  # what CPU Adam would need, beside the GPU's
                raise ConfigError(report.neither_fits_error(
                    best_peak(s, worst, options), usable,
                    host_memory(replace(s, cpu_adam=True)), host)) from None
            if step_peak(s) > usable:  # only the step on the CPU helps: what it would need
                raise
            raise ConfigError(gpu) from None
        cpu.cpu_adam_note = (f"auto: with AdamW on the GPU the update would need "
                             f"~{report.size(best_peak(s, worst, options))} of the "
                             f"{report.size(usable)}")
        return cpu
    if chosen is None:
        raise ConfigError(report.update_error(cfg, s, usable, capacity))
    plan.gradient_checkpointing, plan.optimizer_offload = chosen
    plan.checkpointed_layers = all_or_none(s, chosen.checkpointing)
    if cfg.model.gradient_checkpointing == "auto":
        off = update_peak(s, worst, 0, chosen.offload)
        plan.note = ("auto: the update fits without it" if not chosen.checkpointing else
                     f"auto: without it the update would need ~{report.size(off)}")
        if chosen.checkpointing:
            plan.checkpointed_layers = _fewest_checkpointed(s, worst, chosen, usable)
    lp_worst = max(plan.logprob_tokens, s.longest)
    if logprob_peak(s, lp_worst) > usable:  # the weights (+ a visiting reference) alone
        raise ConfigError(report.logprob_error(logprob_peak(s, lp_worst), usable, lp_worst,
                                               s.reference))
    plan.peaks = {"rollout": need, "logprobs": logprob_peak(s, lp_worst),
                  "update": update_peak(s, worst, plan.checkpointed_layers, chosen.offload)}
    return plan


def keeps_state(s: Setup, capacity: int, usable: int) -> bool:
    """Whether the training state can stay on the GPU through rollouts: the KV pool left
    beside it holds every sequence of a rollout at its largest cache (ZeRO 1-3; without
    ZeRO it never moves). Under CPU Adam only its staging buffer is there, and it stays."""
    if s.cpu_adam:
        return True
    if not s.zero_stage or not s.rollout_sequences:
        return False
    if s.kv_memory:  # a fixed pool: the state must fit beside it
        return rollout_peak(s, capacity, True) <= usable
    return kv_tokens(s, capacity, True) >= rollout_kv_need(s)


def _check_host(s: Setup, host: int) -> None:
    """CPU Adam's host memory (estimate.host_memory) against what this rank may count on."""
    need = host_memory(s)
    if host and need > host:
        raise ConfigError(report.host_error(need, host))


def _logprob_budget(cfg: Config, s: Setup, usable: int) -> int:
    """The setup's log-prob budget, or the largest whose log-prob passes fit."""
    if logprob_peak(s, max(s.logprob_tokens, s.longest)) <= usable:
        return s.logprob_tokens
    fits = lambda n: logprob_peak(s, n) <= usable  # noqa: E731
    n = largest(fits, s.longest, s.logprob_tokens)
    if n is not None:
        return round_down(n, s.longest)
    if s.logprob_chunk == 0:
        raise ConfigError(report.logprob_chunk_error(logprob_peak(s, s.longest), usable))
    return s.longest  # the update cannot fit either: report.update_error names why


# ----------------------------------------------------- planned beside measured, per rollout


def batch_peaks(plan: MemoryPlan, lengths: list[int], num_steps: int,
                steps_done: int) -> dict[str, int]:
    """Planned peaks of one rollout's batch (sequence lengths, prompt + response): its
    largest micro-batches, and whether AdamW moments existed yet (they are made by the
    first optimizer step)."""
    s = plan.setup
    logprob = max(sum(lengths[i] for i in g) for g in pack_by_tokens(lengths, plan.logprob_tokens))
    update = 0
    for k, groups in enumerate(step_micro_batches(lengths, num_steps, plan.update_tokens)):
        for j, group in enumerate(groups):
            tokens = sum(lengths[i] for i in group)
            update = max(update, backward_peak(
                s, tokens, plan.checkpointed_layers, plan.optimizer_offload,
                adam=steps_done + k > 0, accumulating=j > 0))
    return {"rollout": plan.peaks["rollout"],
            "logprobs": logprob_peak(s, logprob, adam=steps_done > 0),
            # the update's later steps find the moments its first step made
            "update": max(update, step_peak(s, adam=steps_done + num_steps > 1))}


def plan_metrics(plan: MemoryPlan, batch, num_steps: int, steps_done: int) -> dict[str, float]:
    """memory_plan/<phase>_gib: what the plan expects of this rollout batch (the largest
    rank's); steps_done: optimizer steps before its update."""
    if plan.setup is None:
        return {}
    lengths = [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses)]
    peaks = batch_peaks(plan, lengths, num_steps, steps_done)
    return {f"memory_plan/{k}_gib": Max(v / GIB) for k, v in peaks.items()}


def plan_errors(metrics: dict[str, float]) -> dict[str, float]:
    """memory_plan/<phase>_error: measured peak / planned - 1, where both were logged."""
    out = {}
    for name in PHASES:
        planned, measured = metrics.get(f"memory_plan/{name}_gib"), metrics.get(f"mem/{name}_peak_gib")
        if planned and measured is not None:
            out[f"memory_plan/{name}_error"] = measured / planned - 1
    return out
