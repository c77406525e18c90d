"""GRPO with the Sparse-RL corrections: the algorithm alone, as functions of tensors.

Read in the order a rollout uses it:
  rollout           a prompt's n samples and their rewards (the group GRPO compares)
  dynamic_sampling  draw again until groups carry signal (DAPO's dynamic sampling)
  advantages        each sample's advantage against its group (or the batch)
  mismatch          how far the sampler (a compressed KV cache) is from the dense policy
  corrections       Sparse-RL: importance weights, rejection, veto, normalisation
  loss              PPO clip, KL to the reference, entropy, aggregation
  objective         one micro-batch's loss, from the rollout batch and the current log-probs

How a policy is stepped on that loss (backward, micro-batches, ranks, the memory plan,
checkpoints, logging) is minisparse.trainer's; train.py joins the two.
"""
