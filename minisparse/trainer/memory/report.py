"""The memory plan in words: the table a run prints at start, the one-line stops (exit 2)
naming the setting that keeps a phase from fitting and what would fit, and the planned
peaks beside the measured ones after the first rollout. The numbers come from estimate.py
and the plan's choices (choices.py, plan.py); nothing here decides."""

from __future__ import annotations

from dataclasses import replace

from minisparse.config.schema import Config
from minisparse.trainer.memory.choices import (HEADROOM, OPTIONS, PHASES, MemoryPlan, allowed,
                                               allowed_options, best_peak, largest, round_down)
from minisparse.trainer.memory.estimate import (GIB, Setup, cpu_peak, host_memory, kv_pool,
                                                kv_tokens, rollout_resident, setup_of,
                                                shape_of, step_peak, training_state)


def gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.0f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _budget(tokens: int, longest: int) -> str:
    alone = f" (a {longest:,}-token sequence alone)" if longest > tokens else ""
    return f"micro-batches up to {tokens:,} tokens{alone}"


def plan_table(plan: MemoryPlan) -> str:
    """What the run prints at start: one line when not planned, else a short table."""
    on = "on" if plan.gradient_checkpointing else "off"
    if plan.gradient_checkpointing and plan.setup and plan.checkpointed_layers is not None:
        on += f" for {plan.checkpointed_layers} of {plan.setup.shape.layers} layers"
    choice = f"gradient checkpointing {on}" + (f" ({plan.note})" if plan.note else "")
    if plan.setup is None:
        return (f"memory plan: no GPU, not planned ({choice}; gpu_memory_gb plans for a "
                f"GPU of that size)")
    s, cap, longest = plan.setup, plan.capacity, plan.setup.longest
    lines = [_head(plan), f"  {'phase':9s} {'peak GiB':>8s}"]
    lines += [f"  {name:9s} {gib(plan.peaks[name]):>8s}  {what}"
              for name, what in _rows(plan, s, cap, longest)]
    lines.append(f"  chosen: {choice}")
    return "\n".join(lines)


def _head(plan: MemoryPlan) -> str:
    s = plan.setup
    return (f"memory plan: {plan.device}, {gib(plan.capacity)} GiB, planned to "
            f"{gib(plan.usable)} ({HEADROOM:.0%} kept free); {_count(s.shape.params)} "
            f"parameters"
            + (f" (LoRA: {_count(s.trainable)} trained)" if s.trainable else "")
            + f", ZeRO {s.zero_stage}"
            + (f" ({plan.zero_note})" if plan.zero_note else "") + f" over {s.world} GPU"
            f"{'s' if s.world > 1 else ''}; sequences up to {s.longest:,} tokens"
            + (f"; optimizer on the CPU (DeepSpeed CPU Adam, {plan.cpu_adam_note}): host "
               f"memory {gib(host_memory(s))} GiB a GPU"
               + (f" of {gib(plan.host)} available" if plan.host else "")
               if s.cpu_adam else ""))


def _rows(plan: MemoryPlan, s: Setup, cap: int, longest: int) -> list[tuple[str, str]]:
    """(phase, what its peak holds) for the table."""
    keep, seqs = plan.keep_state, s.rollout_sequences
    state = (f" + training state {gib(training_state(s))} (kept: {seqs:,} sequences of "
             f"up to {s.rollout_cache:,} tokens fit beside it)" if keep else "")
    if s.cpu_adam:
        state = f" + CPU Adam's gradient staging buffer {gib(training_state(s))}"
    pool = kv_tokens(s, cap, keep)
    return [
        ("rollout", f"weights {gib(rollout_resident(s))}{state} + KV pool "
                    f"{gib(kv_pool(s, cap, keep))}: {pool:,} tokens, "
                    f"{pool // longest:,} uncompressed sequences"),
        ("logprobs", _budget(plan.logprob_tokens, longest)
                     + (", reference model visiting" if s.reference else "")),
        ("update", f"{_budget(plan.update_tokens, longest)}; optimizer step "
                   f"{gib(step_peak(s))}"
                   + (", optimizer state on the CPU during forward/backward"
                      if plan.optimizer_offload else "")
                   + (", the step on the CPU" if s.cpu_adam else "")),
    ]


def comparison_line(metrics: dict[str, float]) -> str:
    """'memory plan vs measured: ...' for the console, after the first rollout."""
    parts = [f"{name} {metrics[f'mem/{name}_peak_gib']:.1f} GiB measured, "
             f"{metrics[f'memory_plan/{name}_gib']:.1f} planned "
             f"({metrics[f'memory_plan/{name}_error']:+.1%})"
             for name in PHASES if f"memory_plan/{name}_error" in metrics]
    return "memory plan vs measured: " + "; ".join(parts) if parts else ""


# ------------------------------------------------------------- the one-line stops (exit 2)


def cpu_adam_build_error(note: str, missing: str) -> str:
    return (f"optimizer_offload=cpu_adam ({note or 'set'}): building DeepSpeed's CPU Adam op "
            f"needs {missing}")


def cpu_adam_stage_error(cfg: Config) -> str:
    return (f"optimizer_offload=cpu_adam runs under ZeRO 1 or 2, not zero_stage="
            f"{cfg.zero_stage}; set zero_stage=1, 2 or auto")


def kv_memory_error(cfg: Config, need: int, usable: int) -> str:
    return (f"engine.kv_memory_gb={cfg.engine.kv_memory_gb:g}: the rollout needs ~{size(need)} "
            f"of the {size(usable)} planned for; set engine.kv_memory_gb<="
            f"{max(0.0, (usable - need) / GIB + cfg.engine.kv_memory_gb):.0f} or 0 "
            f"(engine.kv_memory_fraction of what is free)")


def host_error(need: int, host: int) -> str:
    return (f"optimizer_offload=cpu_adam: the optimizer on the CPU needs ~{size(need)} of host "
            f"memory a GPU, {size(host)} available (MemAvailable over the GPUs of this host); "
            f"use more hosts or GPUs")


def neither_fits_error(gpu_need: int, usable: int, host_need: int, host: int) -> str:
    """optimizer_offload=auto where the update fits neither on the GPU nor, with CPU Adam,
    in the host's memory."""
    return (f"optimizer_offload=auto: the update needs ~{size(gpu_need)} of the {size(usable)} "
            f"planned for on the GPU, and with the optimizer on the CPU (cpu_adam) "
            f"~{size(host_need)} of host memory a GPU, {size(host)} available; use more GPUs "
            f"or hosts")


def logprob_chunk_error(need: int, usable: int) -> str:
    return (f"model.logprob_chunk=0: the log-prob passes need ~{size(need)} of the "
            f"{size(usable)} planned for; set model.logprob_chunk=1024")


def logprob_error(need: int, usable: int, tokens: int, reference: bool) -> str:
    return (f"the log-prob passes need ~{size(need)} of the {size(usable)} planned for at "
            f"{tokens:,} tokens"
            + (" (the reference model visits: loss.kl_coef=0 needs none)" if reference else "")
            + "; use more GPUs or a GPU with more memory")


def update_error(cfg: Config, s: Setup, usable: int, capacity: int) -> str:
    """One line: the setting that keeps the update from fitting, and what would fit."""
    options = allowed_options(cfg, s)
    worst = s.worst_tokens
    need = size(best_peak(s, worst, options))
    where = (f"the update needs ~{need} of the {size(usable)} planned for "
             f"({size(capacity)} GPU, {HEADROOM:.0%} kept free) at "
             f"max_tokens_per_gpu={s.max_tokens} (sequences up to {s.longest} tokens)")
    fixes = _fixes(cfg, s, usable, options)
    fits = lambda n: best_peak(s, n, options) <= usable  # noqa: E731
    budget = largest(fits, s.longest, s.max_tokens - 1)
    smaller = [f"max_tokens_per_gpu<={round_down(budget, s.longest)}"] if budget else []
    if fixes:
        key, value, _ = fixes[0]
        changes = [f"it {fixes[0][2]}"] + [f"{k}={v}" for k, _, v in fixes[1:]] + smaller
        return f"{key}={value}: {where}; set {' or '.join(changes)}"
    if smaller:
        return f"max_tokens_per_gpu={s.max_tokens}: {where}; set {smaller[0]}"
    if step_peak(s) > usable:
        return _step_error(cfg, s, usable)
    prompt = cfg.data.max_prompt_len
    longest = largest(fits, prompt + 1, s.longest - 1)
    shorter = (f"; set max_response_len<={longest - prompt}"
               + (f" and max_tokens_per_gpu<={longest}" if longest < s.max_tokens else "")
               if longest else "")
    return (f"max_response_len={cfg.max_response_len}: one sequence of {s.longest} tokens "
            f"(data.max_prompt_len {prompt} + max_response_len) needs ~{need} in the "
            f"update of the {size(usable)} planned for{shorter}")


def _fixes(cfg: Config, s: Setup, usable: int, options: list) -> list[tuple[str, str, str]]:
    """(setting, value, the change), each alone making the update fit."""
    worst, fixes = s.worst_tokens, []
    if s.logprob_chunk == 0 and best_peak(replace(s, logprob_chunk=1024), worst,
                                          options) <= usable:
        fixes.append(("model.logprob_chunk", "0", "1024"))
    gc, off = cfg.model.gradient_checkpointing, cfg.optimizer_offload
    if gc == "false" and best_peak(s, worst, [o for o in OPTIONS if o.checkpointing
                                              and allowed(off, o.offload)]) <= usable:
        fixes.append(("model.gradient_checkpointing", gc, "true"))
    if off == "false" and best_peak(s, worst, [o for o in OPTIONS if o.offload
                                               and allowed(gc, o.checkpointing)]) <= usable:
        fixes.append(("optimizer_offload", off, "true"))
    return fixes


def _step_error(cfg: Config, s: Setup, usable: int) -> str:
    """Where the optimizer step alone cannot fit."""
    step = step_peak(s)
    stage = f"auto (ZeRO {s.zero_stage})" if cfg.zero_stage == "auto" else s.zero_stage
    if s.cpu_adam:
        return (f"optimizer_offload={cfg.optimizer_offload} (CPU Adam): the optimizer "
                f"step alone needs ~{size(step)} of the {size(usable)} planned for on "
                f"each of {s.world} GPU(s) (the weights, one parameter's gradient); use "
                f"more GPUs or a GPU with more memory")
    cpu = (cfg.zero_stage in ("auto", 2)
           and step_peak(replace(s, cpu_adam=True, zero_stage=2)) <= usable)
    return (f"zero_stage={stage}: the optimizer step alone needs ~{size(step)} "
            f"of the {size(usable)} planned for on each of {s.world} GPU(s) "
            f"(weights, fp32 master weights, AdamW moments, gradients); "
            + ("set optimizer_offload=cpu_adam (the step on the CPU) or " if cpu else "")
            + "use more GPUs")


# What lowers a CPU run's peak, by the phase it falls in.
LOWER = {"update": "a smaller max_tokens_per_gpu or model.gradient_checkpointing=true",
         "checkpointed update": "a smaller max_tokens_per_gpu",
         "log-prob passes": "a smaller logprob_max_tokens_per_gpu",
         "rollout": "a smaller engine.kv_cpu_memory_gb"}


def cpu_memory_line(cfg: Config, plan: MemoryPlan, world: int, reference: bool) -> str:
    """A CPU run's start line: the resident memory it is expected to peak at (estimate.py's
    cpu_peak), where, and what lowers it."""
    import torch

    from minisparse.engine.kv_pool import pool_bytes
    from minisparse.models.loading import model_config

    s = replace(setup_of(cfg, shape_of(model_config(cfg.model.path)), world, liger=False,
                         reference=reference), logprob_tokens=plan.logprob_tokens)
    checkpointed = plan.checkpointed_layers or (s.shape.layers if plan.gradient_checkpointing
                                                else 0)
    peak, phase = cpu_peak(s, checkpointed, pool_bytes(cfg.engine, torch.device("cpu")))
    each = " a process" if world > 1 else ""
    lower = LOWER["checkpointed update" if phase == "update" and checkpointed else phase]
    return (f"memory: about {gib(peak)} GiB resident at its peak{each}, in the {phase} "
            f"({lower} lowers it)")
