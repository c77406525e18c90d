"""The trainer trains: train.py's loop, in-process on a tiny character-level model on the
CPU, learns within four rollouts to write the one token a reward plug-in pays for
(tests/helpers/target_token_reward.py), with a dense and with a compressed (R-KV) KV cache; with
the policy gradient's sign flipped, it does not.

The untrained model writes the target about once in a hundred tokens (tests/helpers/char_model.py),
so 96 responses of up to 16 tokens hold a dozen paid tokens from the first rollout on,
and eight optimizer steps a rollout at a high learning rate make that several a response
by the fourth. Over seeds 1 to 8 and 42, dense and compressed, the reward went from 0.10 to
0.19 a response in the first rollout to 3.9 to 10.6 in the fourth, and to 0.01 or less
with the sign flipped (the compressed runs then counting each sequence's own tokens to
its next compression).
"""
import json
from pathlib import Path

import pytest
from char_model import build_char_model

import train
from minisparse.config.load import load_config
from minisparse.trainer.stop import StopOnSignal

pytestmark = [pytest.mark.algorithm, pytest.mark.usefixtures("process_group")]

PROMPTS = ["Say a number:", "Write something.", "Numbers:", "Go on:", "Count:", "Next:",
           "List:", "Answer:"]
SETTINGS = [
    "reward.function=target_token_reward:pay_for_target",
    "num_rollout=4", "rollout_batch_size=6", "n_samples_per_prompt=16",
    "max_response_len=16", "global_batch_size=12", "num_steps_per_rollout=8",
    "optim.lr=2e-2", "loss.kl_coef=0", "engine.max_num_seqs=96",
    "save_interval=0", "log.tensorboard=false",
    # answers of up to 16 tokens: compressed every 4 of the batch's steps, a cache passes
    # its budget within them (tiny_rkv: budget 16, every 8, would miss the short prompts)
    "compress.divide_length=4",
]


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> list[str]:
    """The settings that point a tiny config at the character-level model and at short
    prompts of our own (so the update's packed rows stay short)."""
    folder = tmp_path_factory.mktemp("learning-task")
    data = folder / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "label": "7"}) + "\n" for p in PROMPTS))
    return [f"model.path={build_char_model(folder / 'model')}", f"data.path={data}"]


def _metrics(config: str, task: list[str], output_dir: Path) -> list[dict]:
    """Each rollout's metrics row from train.py's loop."""
    cfg = load_config(config, [*SETTINGS, *task, f"output_dir={output_dir}"])
    run = train.setup(cfg, resume_required=False)
    signals = StopOnSignal(speak=False)
    try:
        assert train.train(run, signals) is None
    finally:
        signals.close()
        run.logger.close()
    return [json.loads(row) for row in (output_dir / "metrics.jsonl").read_text().splitlines()]


def rose(rewards: list[float]) -> bool:
    """The last rollout pays for at least one target a response, four times the first."""
    return rewards[-1] >= max(1.0, 4 * rewards[0])


@pytest.mark.parametrize("config", ["tiny_dense", "tiny_rkv"])
def test_reward_rises(config, task, tmp_path):
    rows = _metrics(config, task, tmp_path)
    rewards = [row["rollout/reward_mean"] for row in rows]
    assert rose(rewards), rewards
    compressions = [row["compress/compressions_per_sample"] for row in rows]
    if config == "tiny_rkv":  # the sampler really ran on a compressed cache
        assert min(compressions) > 0.5, compressions
    else:
        assert max(compressions) == 0.0, compressions


def test_reward_does_not_rise_with_the_policy_gradient_sign_flipped(task, tmp_path,
                                                                    monkeypatch):
    """Every advantage negated (with no KL term, the whole gradient's sign flipped): the
    compressed run ends below where it began."""
    advantages = train.compute_advantages
    monkeypatch.setattr(train, "compute_advantages",
                        lambda *args, **kwargs: (lambda adv, stats: (-adv, stats))(
                            *advantages(*args, **kwargs)))
    rewards = [row["rollout/reward_mean"] for row in _metrics("tiny_rkv", task, tmp_path)]
    assert not rose(rewards), rewards
    assert rewards[-1] < rewards[0], rewards


def test_the_target_is_one_token(task):
    """Of the model's tokens only the target's holds a 7, so the plug-in pays per token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(task[0].split("=", 1)[1])
    assert [t for t in tokenizer.get_vocab() if "7" in t] == ["7"]
    assert tokenizer.decode(tokenizer.encode("a 77\n")) == "a 77\n"
