"""minisparse: a compact GRPO trainer with sparse (KV-compressed) rollouts for math RL."""

__version__ = "0.1.0"
