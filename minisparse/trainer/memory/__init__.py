"""GPU memory across the phases, one direction of calls: estimate.py says what each phase
needs from the model's shape and the settings; plan.py searches the choices (gradient
checkpointing, optimizer offload, ZeRO stage, micro-batch budgets) against the GPU with
those estimates; phases.py switches memory between the rollout engine and the trainer
as the plan says."""
