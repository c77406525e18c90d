"""The DeepSpeed ZeRO engine that owns the policy during updates.

We hand deepspeed.initialize a torch AdamW (fused on GPU) so nothing is JIT-compiled
(DeepSpeed's FusedAdam needs a CUDA build), and a LambdaLR schedule so DeepSpeed saves
and restores it with the optimizer. Micro-batches per step vary with packing, so
gradient accumulation is unmanaged: backward() per micro-batch (the loss is already
divided by the step's denominator), then one step() per optimizer step.

Under optimizer_offload=cpu_adam (the memory plan's choice where the GPU cannot hold the
optimizer step, or set) it is DeepSpeed's CPU Adam instead, with ZeRO-Offload
(offload_optimizer: cpu, pinned): master weights, moments and the step on the CPU. Its op
is JIT-built on first use (g++ with C++17, ninja, Python headers; ~1-2 minutes, cached in
TORCH_EXTENSIONS_DIR), the one op a run may build.

Nothing else is built either: DeepSpeed's CPU communicator would JIT-compile its
shared-memory all-reduce op at start-up (see skip_unused_ops).

What leaves the GPU between phases, and when, is memory/phases.py's
(TrainingStateOffload); how much each phase needs, memory/estimate.py's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from minisparse.config.schema import Config
from minisparse.utils.distributed import world_size
from minisparse.utils.quiet import hidden_prints


def lr_factor(step: int, cfg: Config, total_steps: int) -> float:
    """Multiplier of optim.lr at optimizer step `step` (0-based): linear warmup from 0,
    then constant, or cosine / linear decay to min_lr at total_steps."""
    o = cfg.optim
    if o.warmup_steps and step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.lr_schedule == "constant" or o.lr == 0:
        return 1.0
    progress = min(1.0, (step - o.warmup_steps) / max(1, total_steps - o.warmup_steps))
    floor = o.min_lr / o.lr
    if o.lr_schedule == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return floor + (1 - floor) * (1 - progress)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only; biases and norm scales are not decayed."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def overlaps_reduction(on_gpu: bool, world: int, zero_stage: int) -> bool:
    """Whether DeepSpeed overlaps gradient reduction with the backward: it pays only where
    there is a reduction (several ranks), and DeepSpeed allows it only at stages 2 and 3
    when gradient accumulation is unmanaged, as here. It then double-buffers the gradient
    bucket, which the memory estimate counts."""
    return on_gpu and world > 1 and zero_stage >= 2


def zero_stage_of(cfg: Config) -> int:
    """The ZeRO stage zero_stage names where no memory plan chose one: auto is ZeRO 2, which
    holds the least (a run passes its plan's choice to build_train_engine)."""
    return 2 if cfg.zero_stage == "auto" else cfg.zero_stage


def cpu_adam_of(cfg: Config) -> bool:
    """Whether optimizer_offload names DeepSpeed's CPU Adam where no memory plan chose."""
    return cfg.optimizer_offload == "cpu_adam"


def deepspeed_config(cfg: Config, on_gpu: bool, world: int = 1, stage: int | None = None,
                     cpu_adam: bool | None = None) -> dict[str, Any]:
    """DeepSpeed's settings; stage and cpu_adam: the memory plan's choices (None: as the
    settings name them, zero_stage_of and cpu_adam_of)."""
    stage = zero_stage_of(cfg) if stage is None else stage
    cpu_adam = cpu_adam_of(cfg) if cpu_adam is None else cpu_adam
    zero: dict[str, Any] = {
        "stage": stage,
        "contiguous_gradients": True,
        "overlap_comm": overlaps_reduction(on_gpu, world, stage),
    }
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if cpu_adam:  # ZeRO-Offload: state and step on the CPU
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        "fp16": {"enabled": cfg.model.dtype == "float16", "initial_scale_power": 16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def unsupported_dtype(dtype: str) -> str | None:
    """Why DeepSpeed's accelerator on this machine does not train in model.dtype (None:
    it does). deepspeed.initialize refuses such a dtype with a traceback; the pre-flight
    says it in one line instead. DeepSpeed's CPU accelerator takes float16 only where
    oneDNN has float16 kernels (AVX512-FP16 or AMX: recent Intel Xeons, not AMD EPYC)."""
    if dtype not in ("float16", "bfloat16"):
        return None
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if (accelerator.is_fp16_supported() if dtype == "float16"
            else accelerator.is_bf16_supported()):
        return None
    name = accelerator.device_name()
    why = " (its CPU has no AVX512-FP16 or AMX)" if name == "cpu" else ""
    other = "bfloat16" if dtype == "float16" else "float16"
    return (f"DeepSpeed's {name} accelerator does not train in {dtype} on this machine{why}; "
            f"use --set model.dtype={other} or --set model.dtype=float32")


# DeepSpeed's CPU shared-memory all-reduce: only DeepSpeed inference's tensor-parallel
# all-reduce calls it; training's collectives go through torch.distributed.
SHM_COMM_OP = "deepspeed_shm_comm"


def skip_unused_ops(deepspeed) -> None:
    """Keep deepspeed.initialize from JIT-building the CPU shared-memory op we never call.

    The build holds a lock file in torch's extensions dir (TORCH_EXTENSIONS_DIR, default
    ~/.cache/torch_extensions/<py>_cpu/deepspeed_shm_comm/lock). A process killed during
    the build (SIGKILL, OOM, preemption) leaves the lock behind, and every later run on
    the machine waited for it forever, silently, inside deepspeed.initialize. An op
    marked incompatible is never built or loaded (deepspeed.comm.torch.build_shm_op)."""
    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


def cpu_adam_missing() -> str:
    """What building DeepSpeed's CPU Adam op needs and this machine lacks ("" when nothing:
    a C++17 compiler, ninja and Python's headers; the build itself then takes ~1-2 min)."""
    import shutil
    import sysconfig

    from torch.utils.cpp_extension import is_ninja_available

    missing = [what for what, ok in (
        ("a C++ compiler (g++ or c++ on PATH)", shutil.which("g++") or shutil.which("c++")),
        ("ninja (pip install ninja)", is_ninja_available()),
        ("Python's headers (Python.h; python3-dev)",
         (Path(sysconfig.get_paths()["include"]) / "Python.h").exists())) if not ok]
    return ", ".join(missing)


def make_optimizer(model: torch.nn.Module, cfg: Config, on_gpu: bool,
                   cpu_adam: bool | None = None) -> torch.optim.Optimizer:
    """torch AdamW (fused on GPU); DeepSpeed's CPU Adam (AdamW's update, decoupled weight
    decay) with cpu_adam (None: as optimizer_offload names it)."""
    o = cfg.optim
    groups = param_groups(model, o.weight_decay)
    betas = (o.adam_beta1, o.adam_beta2)
    if cpu_adam_of(cfg) if cpu_adam is None else cpu_adam:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        missing = cpu_adam_missing()
        if missing:
            raise RuntimeError(f"optimizer_offload=cpu_adam: building DeepSpeed's CPU Adam op "
                               f"needs {missing}")

        class CPUAdamW(DeepSpeedCPUAdam):
            """Resumes from a torch AdamW checkpoint too (optimizer_offload may change on
            resume): its groups lack bias_correction and its steps are tensors."""

            def load_state_dict(self, state_dict) -> None:
                super().load_state_dict(state_dict)
                for group in self.param_groups:
                    group.setdefault("bias_correction", True)
                for state in self.state.values():
                    if torch.is_tensor(state.get("step")):
                        state["step"] = int(state["step"].item())

        return CPUAdamW(groups, lr=o.lr, betas=betas, eps=o.adam_eps,
                        weight_decay=o.weight_decay, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=o.lr, betas=betas, eps=o.adam_eps, fused=on_gpu)


def build_train_engine(model: torch.nn.Module, cfg: Config, total_steps: int,
                       device: torch.device, zero_stage: int | None = None,
                       cpu_adam: bool | None = None):
    """DeepSpeed engine around model with AdamW + LR schedule from cfg.optim; zero_stage
    and cpu_adam: the memory plan's choices (None: as the settings name them)."""
    import deepspeed

    skip_unused_ops(deepspeed)
    on_gpu = device.type == "cuda"
    optimizer = make_optimizer(model, cfg, on_gpu, cpu_adam)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg, total_steps)
    )
    with hidden_prints(cfg.log.verbose):
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=deepspeed_config(cfg, on_gpu, world_size(), zero_stage, cpu_adam),
            dist_init_required=False,
        )
    return engine
