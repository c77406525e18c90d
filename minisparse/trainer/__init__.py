"""The machinery that trains a DeepSpeed policy beside a rollout engine on one GPU per
process: the DeepSpeed engine (train_engine), the memory plan and the phase switches
(memory/), the log-prob passes over packed micro-batches (logprobs, batching), ranks
(distributed), checkpoints, logging, the start and end reports, pre-flight checks and
signals. The algorithm these serve is minisparse.grpo's.
"""
