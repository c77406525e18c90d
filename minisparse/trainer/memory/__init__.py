"""GPU memory across the phases, one direction of calls: estimate.py says what each phase
needs from the model's shape and the settings; choices.py what a plan holds and the
options it searches (gradient checkpointing, optimizer offload); plan.py searches them,
the ZeRO stage and the micro-batch budgets against the GPU with those estimates;
report.py tells the plan in words (its table, the one-line stops); phases.py switches
memory between the rollout engine and the trainer as the plan says."""
