import pytest
import torch
from policy_models import tiny_qwen2
from torch.utils.flop_counter import FlopCounterMode

from minisparse.models.flops import (
    batch_forward_flops,
    flop_shape,
    forward_flops,
    mfu_metrics,
    peak_flops,
)


def _model():
    # hidden 32, 4 query heads of 8, 2 KV heads, MLP 64, vocab 97, 2 layers
    return tiny_qwen2(vocab=97, hidden=32, layers=2, heads=4, kv_heads=2).eval()


def test_shape_counts_the_linear_weights():
    s = flop_shape(_model())
    per_layer = 32 * 32 + 2 * (32 * 16) + 32 * 32 + 3 * 32 * 64  # q, k, v, o, gate/up/down
    assert s.body_params == 2 * per_layer == 18432
    assert (s.head_params, s.layers, s.q_heads, s.head_dim) == (97 * 32, 2, 4, 8)


def test_forward_flops_by_hand():
    s = flop_shape(_model())
    # 8 tokens, 4 of them through the LM head, causal pairs 3*4/2 + 5*6/2 = 21
    expected = 2 * 18432 * 8 + 2 * 3104 * 4 + 4 * 2 * 4 * 8 * 21
    assert forward_flops(s, [3, 5], 4) == expected == 325120
    assert batch_forward_flops(s, [[1, 2], [3, 4]], [[5], [6, 7, 8]]) == expected


def test_forward_flops_agree_with_torch_flop_counter():
    """torch counts every matmul; eager attention's two bmm run over the full (non-causal)
    L x L square, and the rotary table adds a small bmm (2 * D/2 * L) we leave out."""
    model, n, head = _model(), 11, 6
    model.set_attn_implementation("eager")
    ids = torch.randint(0, 97, (1, n))
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        model.lm_head(hidden[0, -head:])
    counts = {str(op): c for op, c in counter.get_flop_counts()["Global"].items()}
    linear = counts["aten.mm"] + counts["aten.addmm"]
    bmm = counts["aten.bmm"]
    s = flop_shape(model)
    ours = forward_flops(s, [n], head)
    causal_attention = 4 * s.layers * s.q_heads * s.head_dim * n * (n + 1) // 2
    rotary = 2 * (s.head_dim // 2) * n
    assert linear == ours - causal_attention
    assert (bmm - rotary) * (n + 1) == causal_attention * 2 * n


def test_peak_and_mfu():
    assert peak_flops(500.0, torch.device("cpu")) == 5e14
    assert peak_flops(0.0, torch.device("cpu")) is None
    m = mfu_metrics("update", 3e15, 10.0, 1e15)
    assert m == pytest.approx({"perf/update_tflops": 300.0, "perf/update_mfu": 0.3})
    assert mfu_metrics("logprobs", 1e12, 2.0, None) == {"perf/logprobs_tflops": 0.5}
