"""Where metrics go: output_dir/metrics.jsonl (one row per rollout), TensorBoard event
files, wandb when asked for and installed, and a one-line console summary. Only rank 0
writes; metrics are reduced over ranks before they get here (see reduce_metrics).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from minisparse.utils.distributed import Max, Sum, all_reduce, world_size
from minisparse.utils.files import atomic_write

# A column of the per-rollout console line: (label, metric, what it means in plain words,
# for the legend printed once at start). The loop names its columns (train.py).
Column = tuple[str, str, str]


def reduce_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Metrics over all ranks: Sum values added, Max values maximised, others averaged
    (see utils/distributed.py). Every rank must call it with the same keys (they run the same
    code path)."""
    if world_size() == 1:
        return dict(metrics)
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    is_max = torch.tensor([isinstance(metrics[k], Max) for k in keys])
    summed = all_reduce(torch.where(is_max, 0.0, values))
    maxed = all_reduce(torch.where(is_max, values, -math.inf), op="max")
    out = {}
    for i, k in enumerate(keys):
        if isinstance(metrics[k], Max):
            out[k] = maxed[i].item()
        else:
            out[k] = summed[i].item() / (1 if isinstance(metrics[k], Sum) else world_size())
    return {k: out[k] for k in metrics}  # the callers' (phase) order


class MetricsLogger:
    def __init__(
        self,
        output_dir: str | Path,
        config: dict[str, Any],
        run_name: str | None,
        tensorboard: bool,
        wandb: bool,
        wandb_project: str,
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.tb = self.wandb = None
        self.tensorboard_dir: Path | None = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Opened at the first row: a writer makes its events file at once, and a run that
        # stops before logging anything should leave no empty one behind.
        self.tensorboard_dir = Path(output_dir) / "tensorboard" if tensorboard else None
        if wandb:
            try:
                import wandb as wb
            except ImportError:
                print("log.wandb is on but wandb is not installed; logging without it")
            else:
                self.wandb = wb.init(
                    project=wandb_project,
                    name=run_name,
                    config=config,
                    dir=str(output_dir),
                    resume="allow",
                )

    def drop_after(self, rollout: int) -> None:
        """On resume: forget rows of rollouts after the checkpoint (they are redone), and a
        torn last line of a killed run. Rewritten atomically."""
        if not self.enabled or not self.path.is_file():
            return
        rows = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a write cut short by the kill
            if isinstance(row, dict) and row.get("rollout", math.inf) <= rollout:
                rows.append(line)
        with atomic_write(self.path) as f:
            f.write("".join(row + "\n" for row in rows))

    def log(self, rollout: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        row = {"rollout": rollout, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is None and self.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(self.tensorboard_dir))
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, rollout)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=rollout)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def summary_legend(columns: Sequence[Column]) -> str:
    """The per-rollout line's columns explained once (two lines), so a newcomer can read it."""
    words = [f"{label} = {meaning}" for label, _, meaning in columns]
    half = len(words) // 2
    return (f"each rollout's line: {', '.join(words[:half])},\n"
            f"  {', '.join(words[half:])}; time = seconds per phase")


def summary_line(rollout: int, metrics: dict[str, float], columns: Sequence[Column],
                 total: int | None = None) -> str:
    """'rollout 3/10 | reward 0.41 | acc 0.38 | ...': the columns whose metrics are present,
    then the phases' seconds."""
    parts = [f"rollout {rollout}" + (f"/{total}" if total else "")]
    for label, key, _ in columns:
        if key in metrics:
            parts.append(f"{label} {metrics[key]:.4g}")
    phases = [k for k in metrics if k.startswith("time/")]
    if phases:
        parts.append("time " + " ".join(f"{k[5:-2]}={metrics[k]:.1f}s" for k in phases))
    return " | ".join(parts)
