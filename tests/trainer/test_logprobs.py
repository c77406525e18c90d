import math

import pytest
import torch
from policy_models import tiny_qwen2

from minisparse.models.attention import use_attention
from minisparse.trainer.logprobs import pack_sequences, pad_rows, response_logprobs

# the current, old and reference log-probs the loss compares: part of the algorithm tier
pytestmark = pytest.mark.algorithm


def _model():
    return tiny_qwen2(vocab=97, hidden=32, layers=2, heads=4, kv_heads=2).eval()


def _reference(model, prompt, response):
    """Unpacked: one sequence, full logits, log-softmax at the response positions."""
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    pos = range(len(prompt) - 1, len(prompt) + len(response) - 1)
    return torch.stack([logp[p, ids[0, p + 1]] for p in pos])


def test_pack_sequences_restarts_positions():
    ids, pos = pack_sequences([[5, 6, 7], [8, 9]], torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7, 8, 9]]
    assert pos.tolist() == [[0, 1, 2, 0, 1]]


def test_pad_rows():
    out = pad_rows(torch.tensor([1.0, 2.0, 3.0]), [2, 1], 3)
    assert out.tolist() == [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
@pytest.mark.parametrize("chunk", [0, 2])
def test_packed_logprobs_equal_unpacked(attention, chunk):
    model = _model()
    use_attention(model, attention)
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    responses = [[10, 11, 12], [13, 14, 15, 16, 17], [18]]
    with torch.no_grad():
        logp, ent = response_logprobs(
            model, prompts, responses, width=6, entropy="detached", chunk=chunk
        )
    assert logp.shape == (3, 6) and ent.shape == (3, 6)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        torch.testing.assert_close(logp[i, : len(r)], _reference(model, p, r), rtol=1e-4, atol=1e-5)
        assert (logp[i, len(r) :] == 0).all()
        assert (ent[i, : len(r)] > 0).all() and (
            ent[i, : len(r)] <= torch.log(torch.tensor(97.0)) + 1e-4
        ).all()


def test_gradients_flow_through_packed_logprobs():
    model = _model()
    logp, ent = response_logprobs(model, [[1, 2]], [[3, 4]], width=2, entropy="grad")
    (logp.sum() + ent.sum()).backward()
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


def test_chunked_entropy_matches_direct():
    from minisparse.trainer.logprobs import entropy_metric, token_logprobs

    logits = torch.tensor([[0.0, 0.0], [0.0, 100.0], [1.0, 2.0]])
    direct = token_logprobs(logits, torch.zeros(3, dtype=torch.long), True)[1]
    torch.testing.assert_close(entropy_metric(logits, chunk=2), direct)
    assert direct[0].item() == pytest.approx(math.log(2))  # uniform over 2
    assert direct[1].item() == pytest.approx(0.0, abs=1e-6)


def test_empty_response_gives_a_zero_row():
    from minisparse.trainer.logprobs import batch_logprobs

    model = _model()
    logp = batch_logprobs(model, [[1, 2], [3, 4]], [[], [5, 6]], width=2, max_tokens=100)
    assert logp[0].tolist() == [0.0, 0.0]
    torch.testing.assert_close(logp[1], _reference(model, [3, 4], [5, 6]), rtol=1e-4, atol=1e-5)


def test_fused_varlen_gradients_equal_unfused_sdpa():
    """The update's path (varlen attention, fused LM head) against the dense-mask SDPA,
    full-logits path: same loss, same gradient on every parameter."""
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    responses = [[10, 11, 12], [13, 14, 15, 16, 17], [18]]
    grads = []
    for attention, chunk in (("sdpa", 0), ("varlen", 4)):
        model = _model()  # float32: the unfused path casts logits to float32 anyway
        use_attention(model, attention)
        logp, ent = response_logprobs(
            model, prompts, responses, width=6, entropy="grad", temperature=0.9, chunk=chunk
        )
        (logp.square().sum() - 0.1 * ent.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6, msg=name)
