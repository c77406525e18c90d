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
  once a step, ZeRO 2 after every micro-batch (4P bytes over PCIe each; measured on the
  CPU: 162 parameter copies against 0 for 2 steps of 3 micro-batches);
* whether the training state (fp32 master weights, AdamW moments, gradient partition)
  stays on the GPU through rollouts: when the KV pool beside it still holds every
  sequence of a rollout at its largest cache (compressed rollouts need little), so the
  swaps between phases move nothing; otherwise it waits on the CPU during rollouts;
* the log-prob passes' micro-batch budget: max_tokens_per_gpu, less where those passes
  would not fit. The update's micro-batches keep max_tokens_per_gpu; a sequence longer
  than it gets a micro-batch of its own (batching.pack_by_tokens), and the plan counts
  that one;
* the ZeRO stage (zero_stage: auto): 1 where its plan gives up nothing of ZeRO 2's (the
  same or fewer checkpointed layers, no optimizer offload that 2 avoids, the training
  state kept through rollouts where 2 keeps it, the same log-prob micro-batches), else 2.
  ZeRO 1 reduces gradients across GPUs once a step instead of after every micro-batch
  (updates 2-12% faster measured on H200s) but holds every gradient on each GPU.

It plans against the memory free on the GPU at start (gpu_memory_gb, when set, caps it;
without a GPU only gpu_memory_gb makes a plan) less HEADROOM, which the estimates leave
out: the CUDA context and library workspaces, and the caching allocator's fragmentation
(6.6 GiB reserved but unallocated at an out-of-memory in the update on an H100 80GB).
After each rollout the planned peaks of that rollout's batch are logged beside the
measured ones (memory_plan/<phase>_gib, memory_plan/<phase>_error).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from minisparse.config.schema import Config, ConfigError
from minisparse.trainer.batching import pack_by_tokens, step_micro_batches
from minisparse.utils.distributed import Max, all_reduce
from minisparse.trainer.memory.estimate import (GIB, Setup, all_or_none, backward_peak,
                                             host_memory, kv_pool,
                                             kv_tokens, logprob_peak, rollout_kv_need,
                                             rollout_peak, rollout_resident, setup_of,
                                             shape_of, step_peak, training_state, update_peak)
from minisparse.trainer.train_engine import zero_stage_of
from minisparse.utils.files import atomic_write

HEADROOM = 0.08  # of the GPU's memory, kept free
# GPU memory in use by other processes at start worth naming (a CUDA context is ~0.5 GiB)
ELSEWHERE = 2 * GIB
PHASES = ("rollout", "logprobs", "update")
# (gradient checkpointing, optimizer offload), the faster first
OPTIONS = ((False, False), (True, False), (False, True), (True, True))


@dataclass
class MemoryPlan:
    gradient_checkpointing: bool
    optimizer_offload: bool
    logprob_tokens: int  # micro-batch budget of the log-prob passes
    update_tokens: int  # max_tokens_per_gpu
    setup: Setup | None = None  # None: not planned (no GPU and no gpu_memory_gb)
    capacity: int = 0  # bytes of the GPU the plan is for
    device: str = ""
    peaks: dict[str, int] | None = None  # phase -> planned peak (bytes), worst case
    note: str = ""  # why gradient checkpointing is on or off
    # decoder layers under gradient checkpointing, the first ones (None: every layer)
    checkpointed_layers: int | None = None
    keep_state: bool = False  # the training state stays on the GPU through rollouts
    zero_stage: int = 2  # DeepSpeed's, as set or chosen (zero_stage: auto)
    zero_note: str = ""  # why, when chosen
    cpu_adam: bool = False  # the optimizer's state and step on the CPU (ZeRO-Offload)
    cpu_adam_note: str = ""  # why, when chosen
    host: int = 0  # bytes of host memory available at start (0: not checked)

    @property
    def usable(self) -> int:
        return int(self.capacity * (1 - HEADROOM))

    def table(self) -> str:
        """What the run prints at start: one line when not planned, else a short table."""
        on = "on" if self.gradient_checkpointing else "off"
        if self.gradient_checkpointing and self.setup and self.checkpointed_layers is not None:
            on += f" for {self.checkpointed_layers} of {self.setup.shape.layers} layers"
        choice = f"gradient checkpointing {on}" + (f" ({self.note})" if self.note else "")
        if self.setup is None:
            return (f"memory plan: no GPU, not planned ({choice}; gpu_memory_gb plans for a "
                    f"GPU of that size)")
        s, cap, longest = self.setup, self.capacity, self.setup.longest
        keep, seqs = self.keep_state, s.rollout_sequences
        state = (f" + training state {_gib(training_state(s))} (kept: {seqs:,} sequences of "
                 f"up to {s.rollout_cache:,} tokens fit beside it)" if keep else "")
        if s.cpu_adam:
            state = f" + CPU Adam's gradient staging buffer {_gib(training_state(s))}"
        pool = kv_tokens(s, cap, keep)
        rows = [
            ("rollout", f"weights {_gib(rollout_resident(s))}{state} + KV pool "
                        f"{_gib(kv_pool(s, cap, keep))}: {pool:,} tokens, "
                        f"{pool // longest:,} uncompressed sequences"),
            ("logprobs", _budget(self.logprob_tokens, longest)
                         + (", reference model visiting" if s.reference else "")),
            ("update", f"{_budget(self.update_tokens, longest)}; optimizer step "
                       f"{_gib(step_peak(s))}"
                       + (", optimizer state on the CPU during forward/backward"
                          if self.optimizer_offload else "")
                       + (", the step on the CPU" if s.cpu_adam else "")),
        ]
        head = (f"memory plan: {self.device}, {_gib(cap)} GiB, planned to "
                f"{_gib(self.usable)} ({HEADROOM:.0%} kept free); {_count(s.shape.params)} "
                f"parameters"
                + (f" (LoRA: {_count(s.trainable)} trained)" if s.trainable else "")
                + f", ZeRO {s.zero_stage}"
                + (f" ({self.zero_note})" if self.zero_note else "") + f" over {s.world} GPU"
                f"{'s' if s.world > 1 else ''}; sequences up to {longest:,} tokens"
                + (f"; optimizer on the CPU (DeepSpeed CPU Adam, {self.cpu_adam_note}): host "
                   f"memory {_gib(host_memory(s))} GiB a GPU"
                   + (f" of {_gib(self.host)} available" if self.host else "")
                   if s.cpu_adam else ""))
        lines = [head, f"  {'phase':9s} {'peak GiB':>8s}"]
        lines += [f"  {name:9s} {_gib(self.peaks[name]):>8s}  {what}" for name, what in rows]
        lines.append(f"  chosen: {choice}")
        return "\n".join(lines)

    def record(self) -> dict:
        """memory_plan.json: the decisions, the peaks (GiB) and what they came from."""
        out = {"gradient_checkpointing": self.gradient_checkpointing,
               "checkpointed_layers": self.checkpointed_layers,
               "keep_state": self.keep_state,
               "zero_stage": self.zero_stage, "zero_note": self.zero_note,
               "optimizer_offload": self.optimizer_offload,
               "cpu_adam": self.cpu_adam, "cpu_adam_note": self.cpu_adam_note,
               "logprob_tokens": self.logprob_tokens, "update_tokens": self.update_tokens,
               "planned": self.setup is not None, "note": self.note}
        if self.setup is not None:
            out |= {"device": self.device, "capacity_gib": self.capacity / GIB,
                    "usable_gib": self.usable / GIB, "headroom": HEADROOM,
                    "host_gib": host_memory(self.setup) / GIB,
                    "host_available_gib": self.host / GIB,
                    "peaks_gib": {k: v / GIB for k, v in self.peaks.items()},
                    "setup": asdict(self.setup)}
        return out

    def save(self, output_dir: str) -> None:
        with atomic_write(Path(output_dir) / "memory_plan.json") as f:
            f.write(json.dumps(self.record(), indent=1))


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def _budget(tokens: int, longest: int) -> str:
    alone = f" (a {longest:,}-token sequence alone)" if longest > tokens else ""
    return f"micro-batches up to {tokens:,} tokens{alone}"


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.0f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def plan_memory(cfg: Config, device: torch.device, world: int) -> MemoryPlan:
    """The run's plan, made before the model loads (ConfigError when it cannot fit)."""
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
    return _buildable(plan_zero_stage(cfg, setup_of(cfg, shape_of(config), world, liger),
                                      capacity, name, host=host))


def _buildable(plan: MemoryPlan) -> MemoryPlan:
    """A plan with CPU Adam stops here (before any model loads) where its op cannot build."""
    from minisparse.trainer.train_engine import cpu_adam_missing

    missing = cpu_adam_missing() if plan.cpu_adam else ""
    if missing:
        raise ConfigError(f"optimizer_offload=cpu_adam ({plan.cpu_adam_note or 'set'}): "
                          f"building DeepSpeed's CPU Adam op needs {missing}")
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
    import os

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
        name += f" ({_gib(total - capacity)} of its {_gib(total)} GiB in use elsewhere)"
    if setting:
        capacity = min(capacity, setting)
    return capacity, name


def _allowed(value: str, option: bool) -> bool:
    return value == "auto" or (value == "true") == option


def _options(cfg: Config, s: Setup | None = None) -> list[tuple[bool, bool]]:
    """(checkpointing, offload between phases) allowed; under CPU Adam nothing to offload."""
    gc, off = cfg.model.gradient_checkpointing, cfg.optimizer_offload
    return [o for o in OPTIONS if _allowed(gc, o[0]) and _allowed(off, o[1])
            and not (o[1] and s is not None and s.cpu_adam)]


def _peak(s: Setup, tokens: int, option: tuple[bool, bool]) -> int:
    """The update's peak under (gradient checkpointing on every layer or none, offload)."""
    return update_peak(s, tokens, all_or_none(s, option[0]), option[1])


def _best(s: Setup, tokens: int, options) -> int:
    return min(_peak(s, tokens, o) for o in options)


def _fewest_checkpointed(s: Setup, tokens: int, offload: bool, usable: int) -> int | None:
    """The fewest layers under gradient checkpointing with which the update fits."""
    return next((n for n in range(s.shape.layers + 1)
                 if update_peak(s, tokens, n, offload) <= usable), None)


def _largest(fits, low: int, high: int) -> int | None:
    """The largest n in [low, high] with fits(n) (fits is monotone), None if none."""
    if low > high or not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _round(n: int, floor: int) -> int:
    """n down to a multiple of 256, but not below floor."""
    return max(floor, n // 256 * 256)


def not_planned(cfg: Config) -> MemoryPlan:
    return MemoryPlan(gradient_checkpointing=cfg.model.gradient_checkpointing == "true",
                      optimizer_offload=cfg.optimizer_offload == "true",
                      cpu_adam=cfg.optimizer_offload == "cpu_adam",
                      logprob_tokens=cfg.max_tokens_per_gpu, update_tokens=cfg.max_tokens_per_gpu,
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
        raise ConfigError(f"optimizer_offload=cpu_adam runs under ZeRO 1 or 2, not zero_stage="
                          f"{cfg.zero_stage}; set zero_stage=1, 2 or auto")
    plan = MemoryPlan(False, False, s.max_tokens, s.max_tokens, s, capacity, device,
                      zero_stage=s.zero_stage, cpu_adam=s.cpu_adam, host=host)
    if s.cpu_adam:
        plan.cpu_adam_note = "optimizer_offload=cpu_adam"
        _check_host(s, host)
    usable = plan.usable
    worst = s.worst_tokens
    need = rollout_peak(s, capacity)
    if s.kv_memory and need > usable:  # (a share of the free memory always fits)
        raise ConfigError(
            f"engine.kv_memory_gb={cfg.engine.kv_memory_gb:g}: the rollout needs ~{_size(need)} of "
            f"the {_size(usable)} planned for; set engine.kv_memory_gb<="
            f"{max(0.0, (usable - need) / GIB + cfg.engine.kv_memory_gb):.0f} or 0 "
            f"(engine.kv_memory_fraction of what is free)")
    plan.keep_state = keeps_state(s, capacity, usable)
    need = rollout_peak(s, capacity, plan.keep_state)
    plan.logprob_tokens = _logprob_budget(cfg, s, usable)
    options = _options(cfg, s)
    chosen = next((o for o in options if _peak(s, worst, o) <= usable), None)
    if chosen is None and cfg.optimizer_offload == "auto" and s.zero_stage in (1, 2) \
            and not s.cpu_adam:
        try:  # the optimizer's state and step to the CPU: what is left to try
            cpu = make_plan(cfg, replace(s, cpu_adam=True), capacity, device, host)
        except ConfigError as error:
            gpu = _update_error(cfg, s, usable, capacity)
            if "host memory" in str(error):  # what CPU Adam would need, beside the GPU's
                cpu_s = replace(s, cpu_adam=True)
                raise ConfigError(
                    f"optimizer_offload=auto: the update needs ~{_size(_best(s, worst, options))}"
                    f" of the {_size(usable)} planned for on the GPU, and with the optimizer on "
                    f"the CPU (cpu_adam) ~{_size(host_memory(cpu_s))} of host memory a GPU, "
                    f"{_size(host)} available; use more GPUs or hosts") from None
            if step_peak(s) > usable:  # only the step on the CPU helps: what it would need
                raise
            raise ConfigError(gpu) from None
        cpu.cpu_adam_note = (f"auto: with AdamW on the GPU the update would need "
                             f"~{_size(_best(s, worst, options))} of the {_size(usable)}")
        return cpu
    if chosen is None:
        raise ConfigError(_update_error(cfg, s, usable, capacity))
    plan.gradient_checkpointing, plan.optimizer_offload = chosen
    plan.checkpointed_layers = all_or_none(s, chosen[0])
    if cfg.model.gradient_checkpointing == "auto":
        off = update_peak(s, worst, 0, chosen[1])
        plan.note = ("auto: the update fits without it" if not chosen[0] else
                     f"auto: without it the update would need ~{_size(off)}")
        if chosen[0]:
            plan.checkpointed_layers = _fewest_checkpointed(s, worst, chosen[1], usable)
    lp_worst = max(plan.logprob_tokens, s.longest)
    if logprob_peak(s, lp_worst) > usable:  # the weights (+ a visiting reference) alone
        raise ConfigError(
            f"the log-prob passes need ~{_size(logprob_peak(s, lp_worst))} of the "
            f"{_size(usable)} planned for at {lp_worst:,} tokens"
            + (" (the reference model visits: loss.kl_coef=0 needs none)" if s.reference
               else "") + "; use more GPUs or a GPU with more memory")
    plan.peaks = {"rollout": need, "logprobs": logprob_peak(s, lp_worst),
                  "update": update_peak(s, worst, plan.checkpointed_layers, chosen[1])}
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
        raise ConfigError(f"optimizer_offload=cpu_adam: the optimizer on the CPU needs ~"
                          f"{_size(need)} of host memory a GPU, {_size(host)} available "
                          f"(MemAvailable over the GPUs of this host); use more hosts or GPUs")


def _logprob_budget(cfg: Config, s: Setup, usable: int) -> int:
    """max_tokens_per_gpu, or the largest budget whose log-prob passes fit."""
    if logprob_peak(s, s.worst_tokens) <= usable:
        return s.max_tokens
    fits = lambda n: logprob_peak(s, n) <= usable  # noqa: E731
    n = _largest(fits, s.longest, s.max_tokens)
    if n is not None:
        return _round(n, s.longest)
    if s.logprob_chunk == 0:
        raise ConfigError(f"model.logprob_chunk=0: the log-prob passes need "
                          f"~{_size(logprob_peak(s, s.longest))} of the {_size(usable)} planned "
                          f"for; set model.logprob_chunk=1024")
    return s.longest  # the update cannot fit either: _update_error names why


def _update_error(cfg: Config, s: Setup, usable: int, capacity: int) -> str:
    """One line: the setting that keeps the update from fitting, and what would fit."""
    options = _options(cfg, s)
    worst = s.worst_tokens
    need = _size(_best(s, worst, options))
    where = (f"the update needs ~{need} of the {_size(usable)} planned for "
             f"({_size(capacity)} GPU, {HEADROOM:.0%} kept free) at "
             f"max_tokens_per_gpu={s.max_tokens} (sequences up to {s.longest} tokens)")
    fixes = []  # (setting, value, the change), each alone making the update fit
    if s.logprob_chunk == 0 and _best(replace(s, logprob_chunk=1024), worst, options) <= usable:
        fixes.append(("model.logprob_chunk", "0", "1024"))
    flips = (("model.gradient_checkpointing", cfg.model.gradient_checkpointing, 0),
             ("optimizer_offload", cfg.optimizer_offload, 1))
    for key, value, i in flips:
        if value == "false":
            freed = [o for o in OPTIONS if o[i] and _allowed(flips[1 - i][1], o[1 - i])]
            if _best(s, worst, freed) <= usable:
                fixes.append((key, value, "true"))
    fits = lambda n: _best(s, n, options) <= usable  # noqa: E731
    budget = _largest(fits, s.longest, s.max_tokens - 1)
    smaller = [f"max_tokens_per_gpu<={_round(budget, s.longest)}"] if budget else []
    if fixes:
        key, value, _ = fixes[0]
        changes = [f"it {fixes[0][2]}"] + [f"{k}={v}" for k, _, v in fixes[1:]] + smaller
        return f"{key}={value}: {where}; set {' or '.join(changes)}"
    if smaller:
        return f"max_tokens_per_gpu={s.max_tokens}: {where}; set {smaller[0]}"
    step = step_peak(s)
    if step > usable:
        stage = f"auto (ZeRO {s.zero_stage})" if cfg.zero_stage == "auto" else s.zero_stage
        if s.cpu_adam:
            return (f"optimizer_offload={cfg.optimizer_offload} (CPU Adam): the optimizer "
                    f"step alone needs ~{_size(step)} of the {_size(usable)} planned for on "
                    f"each of {s.world} GPU(s) (the weights, one parameter's gradient); use "
                    f"more GPUs or a GPU with more memory")
        cpu = (cfg.zero_stage in ("auto", 2)
               and step_peak(replace(s, cpu_adam=True, zero_stage=2)) <= usable)
        return (f"zero_stage={stage}: the optimizer step alone needs ~{_size(step)} "
                f"of the {_size(usable)} planned for on each of {s.world} GPU(s) "
                f"(weights, fp32 master weights, AdamW moments, gradients); "
                + ("set optimizer_offload=cpu_adam (the step on the CPU) or " if cpu else "")
                + "use more GPUs")
    prompt = cfg.data.max_prompt_len
    longest = _largest(fits, prompt + 1, s.longest - 1)
    shorter = (f"; set max_response_len<={longest - prompt}"
               + (f" and max_tokens_per_gpu<={longest}" if longest < s.max_tokens else "")
               if longest else "")
    return (f"max_response_len={cfg.max_response_len}: one sequence of {s.longest} tokens "
            f"(data.max_prompt_len {prompt} + max_response_len) needs ~{need} in the "
            f"update of the {_size(usable)} planned for{shorter}")


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


def comparison_line(metrics: dict[str, float]) -> str:
    """'memory plan vs measured: ...' for the console, after the first rollout."""
    parts = [f"{name} {metrics[f'mem/{name}_peak_gib']:.1f} GiB measured, "
             f"{metrics[f'memory_plan/{name}_gib']:.1f} planned "
             f"({metrics[f'memory_plan/{name}_error']:+.1%})"
             for name in PHASES if f"memory_plan/{name}_error" in metrics]
    return "memory plan vs measured: " + "; ".join(parts) if parts else ""
