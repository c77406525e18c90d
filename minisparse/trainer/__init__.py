"""The machinery that trains a DeepSpeed policy beside a rollout engine on one GPU per
process: the DeepSpeed engine and one optimizer step over micro-batches for any loss
(train_engine, update), the policy and its reference (policy), the memory plan and the
phase switches (memory/), the log-prob passes over packed micro-batches (logprobs,
batching), checkpoints, logging, the start and end reports, pre-flight checks and signals.
It knows no algorithm: train.py hands it GRPO's loss (minisparse.grpo).
"""
