"""The setups the memory tests compute by hand."""
from minisparse.config.load import load_config
from minisparse.trainer.memory.estimate import GIB, setup_of

# An H100 80GB: torch reports 79.2 GiB, ~78.6 free at start; a round 79 GiB here.
# The plan counts on 92% of it: 0.92 x 79 = 72.68 GiB.
H100 = 79 * GIB


def zero2_setup(shape, *overrides: str, world: int = 1):
    """(cfg, setup) of qwen3b_rkv under ZeRO 2, whose bucket flushes the hand-computed
    figures follow (the config's own ZeRO 1: test_zero_1_by_hand)."""
    cfg = load_config("qwen3b_rkv", ["data.max_prompt_len=160", "zero_stage=2", *overrides])
    return cfg, setup_of(cfg, shape, world, liger=True, reference=cfg.loss.kl_coef > 0)
