"""GRPO training pieces that train.py calls one phase at a time.

advantages (group-relative advantages), corrections (Sparse-RL importance weights,
rejection, veto, normalisation), loss (PPO clip, KL, entropy, aggregation), mismatch
(sampler vs dense policy metrics), batching (token-budget packing), logprobs (dense
forward over packed sequences), rollout (engine outputs -> samples), optim (DeepSpeed
setup and memory phases), checkpoint (atomic HF + resume state), logger (jsonl,
TensorBoard, wandb, console).
"""
