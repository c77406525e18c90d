"""train.py's log-prob and update phases, called as the loop calls them, checked by value.

The batch is tests/helpers/worked_example.py's: the sampler's log-probs sit below the policy's by
the table's ratios (some truncated, rejected, one sample vetoed), the reference is another
model, and the policy moves between the two phases as it does after a step, so rollout,
old, reference and current log-probs all differ. Swapping any two of them, dropping the
weights or the kept-token mask, or the sampling temperature, changes a number below.
"""
import copy

import pytest
import torch
import worked_example as ex
from policy_models import tiny_qwen2
from update_helpers import grads_at_step, rollout_batch

import train
from minisparse.config.schema import Config
from minisparse.trainer.logprobs import response_logprobs
from minisparse.trainer.memory.choices import MemoryPlan
from minisparse.trainer.policy import Reference
from minisparse.trainer.train_engine import build_train_engine

pytestmark = pytest.mark.algorithm
TEMPERATURE = 0.8  # both phases divide the logits by it


def _model(seed: int) -> torch.nn.Module:
    return tiny_qwen2(vocab=50, hidden=16, layers=1, heads=2, kv_heads=1, max_positions=64,
                      seed=seed)


def _run(device: torch.device) -> train.Run:
    """What setup() builds, for the parts these two phases read: a ZeRO 0 float32 policy
    (its gradients stay in .grad for the test to read), a reference on the CPU, a plan
    whose log-prob budget splits the batch into micro-batches."""
    cfg = Config(rollout_batch_size=3, n_samples_per_prompt=1, global_batch_size=3,
                 num_steps_per_rollout=1, max_tokens_per_gpu=100, zero_stage=0,
                 temperature=TEMPERATURE)
    cfg.model.dtype = "float32"
    cfg.loss = ex.loss_config()
    engine = build_train_engine(_model(seed=0).to(device), cfg, total_steps=10, device=device)
    plan = MemoryPlan(gradient_checkpointing=False, optimizer_offload=False, logprob_tokens=8,
                      update_tokens=cfg.max_tokens_per_gpu)
    return train.Run(cfg=cfg, device=device, train_engine=engine, swaps=None,
                     reference=Reference(_model(seed=1).eval(), device), llm=None, plan=plan,
                     tokenizer=None, rows=[], sampler=None, logger=None)


def _logprobs(model: torch.nn.Module) -> torch.Tensor:
    return response_logprobs(model, ex.PROMPTS, ex.RESPONSES, width=3,
                             temperature=TEMPERATURE)[0]


def _oracle(model: torch.nn.Module, batch) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """The step's loss parts and gradients from the definitions, on a copy of the policy:
    ratio q = pi_now / pi_old, PPO clip [0.8, 1.2], weights, k3 KL to the reference,
    token_mean over the kept tokens."""
    now = _logprobs(model).cpu()
    keep, w = batch.keep.float(), batch.weights
    q = torch.exp(now - batch.old_logp)
    adv = batch.advantages[:, None]
    pg = torch.maximum(-adv * q, -adv * q.clamp(0.8, 1.2))
    log_k = now - batch.ref_logp
    kl = torch.exp(-log_k) + log_k - 1
    mean = lambda x: (x * keep).sum() / keep.sum()
    parts = {"pg_loss": mean(w * pg), "kl": mean(kl), "ratio_mean": mean(q),
             "clip_frac": mean((-adv * q.clamp(0.8, 1.2) > -adv * q).float())}
    (parts["pg_loss"] + ex.KL_COEF * parts["kl"]).backward()
    grads = {n: p.grad.cpu() for n, p in model.named_parameters()}
    return {k: v.item() for k, v in parts.items()}, grads


def test_logprob_and_update_phases_by_value(process_group):
    run = _run(process_group)
    policy = run.train_engine.module
    with torch.no_grad():
        old, ref = _logprobs(policy).cpu(), _logprobs(run.reference.module.to(run.device)).cpu()
    run.reference.module.cpu()
    batch = rollout_batch(ex.PROMPTS, ex.RESPONSES, old - torch.tensor(ex.S).log())
    batch.advantages = ex.ADVANTAGES

    batch, metrics = train.logprob_phase(run, batch)
    torch.testing.assert_close(batch.old_logp * batch.response_mask, old * ex.MASK)
    torch.testing.assert_close(batch.ref_logp * batch.response_mask, ref * ex.MASK)
    keep, weights = ex.expected()  # the table's sampler ratios, token level
    assert batch.keep.tolist() == keep.tolist()
    torch.testing.assert_close(batch.weights, weights, rtol=1e-4, atol=1e-6)
    s = torch.tensor(ex.S)[ex.MASK]  # the 7 response tokens' sampler ratios
    assert metrics["mismatch/kl_k1"] == pytest.approx(-s.log().mean().item(), rel=1e-4)
    assert metrics["rs/vetoed_seqs"] == 1.0

    with torch.no_grad():  # the policy moves, as one optimizer step would move it
        generator = torch.Generator().manual_seed(0)
        for p in policy.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator).to(p.device))
    want, want_grads = _oracle(copy.deepcopy(policy), batch)
    assert 0.0 < want["clip_frac"] < 1.0 and want["ratio_mean"] != pytest.approx(1.0, abs=1e-3)

    grads = grads_at_step(run.train_engine)
    metrics = train.update_phase(run, batch)
    for name, value in want.items():
        assert metrics[f"train/{name}"] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    assert metrics["train/nonfinite_steps"] == 0.0 and metrics["train/step"] == 1.0
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-3, atol=1e-6, msg=name)
