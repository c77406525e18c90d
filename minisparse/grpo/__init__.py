"""GRPO with the Sparse-RL corrections: the algorithm, and nothing else.

Read in the order a rollout uses it:
  rollout           a prompt's n samples and their rewards (the group GRPO compares)
  dynamic_sampling  draw again until groups carry signal (DAPO's dynamic sampling)
  advantages        each sample's advantage against its group (or the batch)
  mismatch          how far the sampler (a compressed KV cache) is from the dense policy
  corrections       Sparse-RL: importance weights, rejection, veto, normalisation
  loss              PPO clip, KL to the reference, entropy, aggregation
  update            one optimizer step: micro-batch losses combined, then the step

The machinery that feeds a DeepSpeed policy (memory plan and phases, checkpoints, ranks,
logging) is minisparse.trainer's; the training passes' kernels sit with the models.
"""
