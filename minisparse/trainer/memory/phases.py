"""The phase switches: the swap of GPU memory between the rollout engine (KV pool) and
the trainer (optimizer states). Each phase's wall time and peak memory: trainer/measure.py.

`Swaps` is what the loop calls: to_rollout before a rollout (or an evaluation), to_training
after it, and `sampling` around the engine's generate calls. Under LoRA the engine samples
with a merged copy of the adapted weights (models/lora.py): made before the KV pool takes
its share, freed for training.

Rollout and training share one GPU: `rollout_memory` frees what training holds but the
engine does not need (optimizer states, fp32 master weights, gradient buffers) and gives
the engine its KV pool back; `train_memory` does the reverse. Where the memory plan keeps
the training state on the GPU (the rollout's KV cache fits beside it), only the KV pool
changes hands (estimate.py counts what each side holds; plan.py decides). Where the
plan asks for it (optimizer_offload), the optimizer states and master weights also wait
on the CPU during the update's forward and backward passes. The reference model lives
on the CPU and visits the GPU for its one forward pass per rollout (`visiting`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from minisparse.models.lora import MergedWeights, lora_enabled


class TrainingStateOffload:
    """Moves what only the update needs off the GPU for the rollout, and back.

    deepspeed 0.19.8's offload_states / reload_states (ZeRO 1/2 and 3) move the AdamW
    moments, fp32 master weights and gradient buffers to pinned CPU memory. The bf16
    weights stay: the engine samples with them. A no-op on CPU, for ZeRO 0 and under CPU
    Adam (optimizer_offload=cpu_adam), whose state lives on the CPU already (DeepSpeed's
    reload_states would bring its master weights to the GPU).
    """

    def __init__(self, train_engine) -> None:
        self.train_engine = train_engine
        device = next(train_engine.module.parameters()).device
        self.active = (train_engine.zero_optimization_stage() > 0 and device.type == "cuda"
                       and not train_engine.zero_cpu_offload())

    def offload(self) -> None:
        """Everything the update alone needs: for the rollout."""
        self._offload("optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer")

    def offload_optimizer(self) -> None:
        """AdamW moments and fp32 master weights, for the update's forward and backward
        passes (optimizer_offload): reload() brings them back for the optimizer step."""
        self._offload("optim_states", "hp_params")

    def _offload(self, *names: str) -> None:
        if self.active:
            from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

            include = [getattr(S, name) for name in names]
            self.train_engine.offload_states(include=include, pin_memory=True)

    def reload(self) -> None:
        if self.active:
            self.train_engine.reload_states()


def free_training_memory(offload: TrainingStateOffload, device: torch.device,
                         keep_state: bool = False) -> None:
    """Optimizer states, master weights and gradient buffers off the GPU unless keep_state
    (no-op on CPU)."""
    if not keep_state:
        offload.offload()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def rollout_memory(offload: TrainingStateOffload, llm, device: torch.device,
                   keep_state: bool = False) -> None:
    """Training -> rollout: training memory freed (but for the state kept on the GPU), then
    the KV pool allocated (a share of what is free then)."""
    free_training_memory(offload, device, keep_state)
    llm.wake()


def train_memory(offload: TrainingStateOffload, llm, device: torch.device) -> None:
    """Rollout -> training: KV pool released, optimizer states back (what was moved)."""
    llm.sleep()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    offload.reload()


@contextmanager
def visiting(module: torch.nn.Module, device: torch.device) -> Iterator[torch.nn.Module]:
    """The module on `device` for the block, on the CPU otherwise (GPU runs only): the
    reference model is needed for one forward pass per rollout, not during the update.

    Its weights never change, so the CPU copy is kept (page-locked on the first visit,
    so the copy in runs at full PCIe speed) and the GPU copy is simply dropped after the
    block: no copy back, no fresh host allocation each rollout."""
    if device.type != "cuda":
        yield module
        return
    tensors = [*module.parameters(), *module.buffers()]  # tied weights appear once
    home = []
    for t in tensors:
        if not t.data.is_pinned():
            t.data = t.data.pin_memory()
        home.append(t.data)
        t.data = t.data.to(device, non_blocking=True)
    try:
        yield module
    finally:
        for t, cpu in zip(tensors, home):
            t.data = cpu
        torch.cuda.empty_cache()


def rollout_weights(train_engine):
    """Context in which the engine may read full weights: under ZeRO 3 the parameters
    are gathered for the duration (and the engine re-bound inside it); a no-op below."""
    if train_engine.zero_optimization_stage() != 3:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(train_engine.module.parameters()))


class Swaps:
    """The GPU's memory handed between the rollout engine and training, as the memory plan
    says (keep_state: the training state stays on the GPU through rollouts)."""

    def __init__(self, train_engine, device: torch.device, keep_state: bool) -> None:
        self.train_engine, self.device, self.keep_state = train_engine, device, keep_state
        self.offload = TrainingStateOffload(train_engine)
        self.sampling_side = False  # the last swap went to the rollout
        module = train_engine.module
        self.merged = MergedWeights(module) if lora_enabled(module) else None

    def sampled_model(self) -> torch.nn.Module:
        """What the engine samples with: the policy, or under LoRA a plain model of its
        merged weights (W + scale * B A, as the last swap to a rollout made them)."""
        return self.train_engine.module if self.merged is None else self.merged.model

    def first(self) -> None:
        """Before the engine is built: its KV pool is sized from the memory free once the
        training state is off the GPU (where the plan moves it) and the merged copy made."""
        free_training_memory(self.offload, self.device, self.keep_state)
        if self.merged is not None:
            self.merged.refresh()

    def to_rollout(self, llm, keep_state: bool | None = None) -> None:
        """Training -> rollout: the merged copy first, then the KV pool its share;
        keep_state: this once (an evaluation's pool gets all the room: False)."""
        if self.merged is not None:
            self.merged.refresh()
        rollout_memory(self.offload, llm, self.device,
                       self.keep_state if keep_state is None else keep_state)

    def to_training(self, llm) -> None:
        """Rollout -> training: the KV pool released, the state back, the merged copy freed."""
        train_memory(self.offload, llm, self.device)
        if self.merged is not None:
            self.merged.release()
        self.sampling_side = False

    def back_to_training(self, llm) -> None:
        """to_training, where a rollout stopped before it (a stop before its update)."""
        if self.sampling_side:
            self.to_training(llm)

    @contextmanager
    def sampling(self, llm) -> Iterator[None]:
        """The block in which the engine samples with the policy's current weights
        (gathered whole for it under ZeRO 3)."""
        with rollout_weights(self.train_engine):
            llm.update_weights(self.sampled_model())
            yield
