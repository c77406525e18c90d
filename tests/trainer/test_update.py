"""trainer/update.py on its own, with a loss of the test's (not GRPO's): the micro-batches'
losses add up to one step's, their metrics are summed, and the divisor shares a count over
the ranks."""
import copy

import pytest
import torch
from policy_models import tiny_qwen2
from update_helpers import grads_at_step

from minisparse.config.schema import Config
from minisparse.trainer.update import accumulate_and_step, rank_share

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.algorithm
TOKENS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]  # one sequence a row


def _loss(model, rows):
    """Sum over the rows' tokens of the logit of token 0, / 10: a loss every weight of the
    head and layers feeds."""
    total = sum(model(input_ids=torch.tensor([TOKENS[i]], device=model.device)).logits[..., 0]
                .sum() for i in rows) / 10
    return total, {"m/loss": total.detach(), "m/rows": torch.tensor(float(len(rows)))}


def test_micro_batches_sum_to_one_step(process_group):
    from minisparse.trainer.train_engine import build_train_engine

    cfg = Config(zero_stage=0)
    cfg.model.dtype = "float32"
    model = tiny_qwen2(vocab=50, hidden=16, layers=1, heads=2, kv_heads=1,
                       max_positions=64).to(process_group)
    oracle = copy.deepcopy(model)
    train_engine = build_train_engine(model, cfg, total_steps=10, device=process_group)
    grads = grads_at_step(train_engine)
    m = accumulate_and_step(train_engine, [[0, 2], [1], [3]],
                            lambda rows: _loss(train_engine.module, rows))
    whole, _ = _loss(oracle, [0, 1, 2, 3])
    whole.backward()
    for name, p in oracle.named_parameters():
        torch.testing.assert_close(grads[name], p.grad.cpu(), rtol=1e-5, atol=1e-7, msg=name)
    assert m["m/loss"] == pytest.approx(whole.item(), rel=1e-5) and m["m/rows"] == 4.0
    assert m["train/micro_batches"] == 3.0 and m["train/step_skipped"] == 0.0
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in oracle.parameters()]))
    assert m["train/grad_norm"] == pytest.approx(norm.item(), rel=1e-4)  # ZeRO 0 fp32: ours


def test_rank_share_on_one_process():
    assert rank_share(6.0) == 6.0
    assert rank_share(0.0) == 1.0  # an empty step divides by 1, not 0
