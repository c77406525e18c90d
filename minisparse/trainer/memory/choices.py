"""What a memory plan holds (MemoryPlan) and what it chooses among: for the update, an
Option of gradient checkpointing and optimizer offload, and the searches over them that
the plan (plan.py) and its messages (report.py) both make."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

from minisparse.config.schema import Config
from minisparse.trainer.memory.estimate import GIB, Setup, all_or_none, host_memory, update_peak
from minisparse.utils.files import atomic_write

HEADROOM = 0.08  # of the GPU's memory, kept free
PHASES = ("rollout", "logprobs", "update")


class Option(NamedTuple):
    """How the update may fit: gradient checkpointing on every layer (or none), and the
    optimizer state waiting on the CPU during its forward and backward passes."""

    checkpointing: bool
    offload: bool


OPTIONS = (Option(False, False), Option(True, False), Option(False, True),
           Option(True, True))  # the faster first


@dataclass
class MemoryPlan:
    gradient_checkpointing: bool
    optimizer_offload: bool
    logprob_tokens: int  # micro-batch budget of the log-prob passes
    update_tokens: int  # micro-batch budget of the update (max_tokens_per_gpu)
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


def allowed(value: str, choice: bool) -> bool:
    """Whether an auto | true | false setting allows the choice."""
    return value == "auto" or (value == "true") == choice


def allowed_options(cfg: Config, s: Setup | None = None) -> list[Option]:
    """The options the settings allow; under CPU Adam nothing to offload."""
    gc, off = cfg.model.gradient_checkpointing, cfg.optimizer_offload
    return [o for o in OPTIONS if allowed(gc, o.checkpointing) and allowed(off, o.offload)
            and not (o.offload and s is not None and s.cpu_adam)]


def option_peak(s: Setup, tokens: int, option: Option) -> int:
    """The update's peak under an option (checkpointing on every layer or none)."""
    return update_peak(s, tokens, all_or_none(s, option.checkpointing), option.offload)


def best_peak(s: Setup, tokens: int, options: Iterable[Option]) -> int:
    """The update's lowest peak over the options."""
    return min(option_peak(s, tokens, o) for o in options)


def largest(fits: Callable[[int], bool], low: int, high: int) -> int | None:
    """The largest n in [low, high] with fits(n) (fits is monotone), None if none."""
    if low > high or not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def round_down(n: int, floor: int) -> int:
    """n down to a multiple of 256, but not below floor."""
    return max(floor, n // 256 * 256)
