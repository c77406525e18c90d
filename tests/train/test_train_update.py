"""train.py's update phase with DeepSpeed (GRPO's loss stepped by trainer/update.py), on
the GPU where there is one (nccl), else on the CPU (gloo); one process unless a test
spawns two."""

import math
import os

import pytest
import torch
import worked_example as ex
from policy_models import tiny_qwen2
from spawned_ranks import spawned_rank
from update_helpers import grads_at_step, rollout_batch, update

from minisparse.config.schema import Config
from minisparse.grpo.corrections import compute_corrections
from minisparse.grpo.batch import RolloutBatch
from minisparse.trainer.logprobs import response_logprobs

deepspeed = pytest.importorskip("deepspeed")
pytestmark = pytest.mark.algorithm


@pytest.fixture(scope="module")
def device(process_group) -> torch.device:
    return process_group


def _cfg(**top) -> Config:
    cfg = Config(
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        global_batch_size=4,
        num_steps_per_rollout=1,
        max_tokens_per_gpu=1000,
    )
    cfg.model.dtype = "float32"
    cfg.optim.lr = 1e-2
    cfg.loss.kl_coef = 0.0
    cfg.loss.aggregation = "token_mean"
    for k, v in top.items():
        setattr(cfg, k, v)
    return cfg


def _model(device: torch.device) -> torch.nn.Module:
    return tiny_qwen2(vocab=50, hidden=16, layers=1, heads=2, kv_heads=1,
                      max_positions=64).to(device)


def _train_engine(cfg: Config, device: torch.device):
    from minisparse.trainer.train_engine import build_train_engine

    return build_train_engine(_model(device), cfg, total_steps=10, device=device)


def _batch(cfg: Config) -> RolloutBatch:
    """Four samples, the dense policy 0.8x as likely as the sampler on every token."""
    responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    batch = rollout_batch([[1, 2], [1, 2], [3, 4, 2], [3, 4, 2]], responses,
                          torch.full((4, 4), -3.0))
    batch.old_logp = (batch.rollout_logp + math.log(0.8)) * batch.response_mask
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    corr = compute_corrections(batch.old_logp, batch.rollout_logp, batch.response_mask,
                               cfg.loss)
    batch.weights, batch.keep = corr.weights, corr.keep
    return batch


def _params(train_engine):
    return torch.cat([p.detach().flatten().cpu() for p in train_engine.module.parameters()])


def _well_conditioned_adam(cfg: Config) -> Config:
    """Adam's first step moves each weight by lr * g / (|g| + eps): with the default eps of
    1e-8, a gradient entry of ~1e-8 (a near-cancelling sum) maps float32 rounding noise in
    g, which depends on the summation order and so on the CPU's kernels, to a change of
    up to lr / 4 in the weight. With eps = 1 the step is ~lr * g for these small
    gradients, so weights agree as closely as the gradients themselves, and a real
    micro-batching error (a wrong divisor, a missed micro-batch) still moves them by
    orders of magnitude more than the tolerance below."""
    cfg.optim.adam_eps = 1.0
    return cfg


def test_step_updates_and_micro_batching_is_exact(device):
    whole_cfg = _well_conditioned_adam(_cfg())
    whole = _train_engine(whole_cfg, device)
    m_whole = update(whole, _batch(whole_cfg), whole_cfg)
    split_cfg = _well_conditioned_adam(_cfg())
    split = _train_engine(split_cfg, device)
    before = _params(split)
    # the memory plan's budget, not max_tokens_per_gpu, packs the update: [7] [5,4] [4]
    m_split = update(split, _batch(split_cfg), split_cfg, update_tokens=9)
    assert m_whole["train/micro_batches"] == 1.0 and m_split["train/micro_batches"] == 3.0
    assert m_split["train/nonfinite_steps"] == 0.0
    assert not torch.equal(before, _params(split))
    assert m_split["train/pg_loss"] == pytest.approx(m_whole["train/pg_loss"], rel=1e-5)
    assert m_split["train/grad_norm"] == pytest.approx(m_whole["train/grad_norm"], rel=1e-4)
    torch.testing.assert_close(_params(split), _params(whole), rtol=1e-5, atol=1e-6)
    assert m_split["train/lr"] == pytest.approx(1e-2)


def test_fp32_zero_0_reports_the_norm_deepspeed_leaves_out(device):
    """Under ZeRO 0 without bf16/fp16 DeepSpeed reports no gradient norm; the step measures
    it (the same as ZeRO 1's on the same batch), so a finite step is not counted skipped."""
    metrics, params = {}, {}
    for stage in (0, 1):
        cfg = _well_conditioned_adam(_cfg(zero_stage=stage))
        train_engine = _train_engine(cfg, device)
        metrics[stage] = update(train_engine, _batch(cfg), cfg)
        params[stage] = _params(train_engine)
    assert metrics[0]["train/nonfinite_steps"] == 0.0
    assert metrics[0]["train/grad_norm"] == pytest.approx(metrics[1]["train/grad_norm"],
                                                          rel=1e-5)
    torch.testing.assert_close(params[0], params[1], rtol=1e-5, atol=1e-6)
    cfg = _cfg(zero_stage=0)
    batch = _batch(cfg)
    batch.advantages = torch.tensor([float("nan"), 1.0, 1.0, 1.0])
    assert update(_train_engine(cfg, device), batch, cfg)["train/nonfinite_steps"] == 1.0


def test_nonfinite_loss_skips_the_step(device):
    cfg = _cfg()
    train_engine = _train_engine(cfg, device)
    batch = _batch(cfg)
    batch.advantages = torch.tensor([float("nan"), 1.0, 1.0, 1.0])
    before = _params(train_engine)
    m = update(train_engine, batch, cfg)
    assert m["train/nonfinite_steps"] == 1.0
    assert not math.isfinite(m["train/grad_norm"])
    assert torch.equal(before, _params(train_engine))
    # the next, finite step is applied normally
    m2 = update(train_engine, _batch(cfg), cfg)
    assert m2["train/nonfinite_steps"] == 0.0 and not torch.equal(before, _params(train_engine))


def test_optimizer_offload_brackets_the_micro_batches_of_each_step(device):
    """optimizer_offload (memory plan): the optimizer state leaves before a step's first
    micro-batch and is back before DeepSpeed's step (on a GPU; TrainingStateOffload is a
    no-op on CPU, so a recorder stands in for it here)."""
    cfg = _cfg(global_batch_size=2, num_steps_per_rollout=2, max_tokens_per_gpu=5)
    train_engine = _train_engine(cfg, device)
    events = []
    step = train_engine.step
    train_engine.step = lambda *a, **k: (events.append("step"), step(*a, **k))[1]
    backward = train_engine.backward
    train_engine.backward = lambda *a, **k: (events.append("backward"), backward(*a, **k))[1]

    class Recorder:
        def offload_optimizer(self):
            events.append("offload")

        def reload(self):
            events.append("reload")

    metrics = update(train_engine, _batch(cfg), cfg, offload=Recorder())
    # sequences of 5 + 4 and 7 + 4 tokens: two micro-batches a step (the 7 alone)
    assert metrics["train/micro_batches"] == 2.0
    assert events == ["offload", "backward", "backward", "reload", "step"] * 2


def _worked_example(cfg: Config, model: torch.nn.Module) -> RolloutBatch:
    """tests/helpers/worked_example.py's three samples, its ratios anchored on the model's own
    log-probs: the update sees q against the old policy, s in the weights, k against the
    reference, whatever the model's values."""
    with torch.no_grad():
        now, _ = response_logprobs(model, ex.PROMPTS, ex.RESPONSES, width=3)
    t = ex.tensors(now.cpu())
    batch = rollout_batch(ex.PROMPTS, ex.RESPONSES, t["rollout"])
    batch.old_logp, batch.ref_logp, batch.advantages = t["old"], t["ref"], ex.ADVANTAGES
    corr = compute_corrections(batch.old_logp, batch.rollout_logp, batch.response_mask,
                               cfg.loss)
    batch.weights, batch.keep = corr.weights, corr.keep
    return batch


@pytest.mark.parametrize("max_tokens", [100, 7], ids=["one_micro_batch", "one_per_sample"])
def test_update_by_hand_on_the_worked_example(device, max_tokens):
    """One optimizer step on the worked example: the loss's parts are the hand-computed
    ones, and the gradient is sum_t g_t * grad log pi_now(t) with the hand-computed
    per-token factors g_t (so the ratio's anchor, weights, kept tokens, clip sides and KL
    direction are all pinned)."""
    cfg = _cfg(max_tokens_per_gpu=max_tokens, zero_stage=0, rollout_batch_size=3,
               n_samples_per_prompt=1, global_batch_size=3)
    cfg.loss = ex.loss_config()
    train_engine = _train_engine(cfg, device)
    grads = grads_at_step(train_engine)
    m = update(train_engine, _worked_example(cfg, train_engine.module), cfg)
    keep, weights = ex.expected()
    want = ex.expected_loss(keep, weights)
    assert m["train/micro_batches"] == (1.0 if max_tokens == 100 else 3.0)
    for name in ("pg_loss", "kl", "ratio_mean", "clip_frac", "loss"):
        assert m[f"train/{name}"] == pytest.approx(want[name], rel=1e-4, abs=1e-6), name

    oracle = _model(device)  # the DeepSpeed engine's model before its step (same seed)
    now, _ = response_logprobs(oracle, ex.PROMPTS, ex.RESPONSES, width=3)
    (ex.expected_grad(keep, weights).to(device) * now).sum().backward()
    expect = {n: p.grad.cpu() for n, p in oracle.named_parameters()}
    assert grads.keys() == expect.keys()
    for name, g in expect.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-3, atol=1e-6, msg=name)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in expect.values()]))
    assert m["train/grad_norm"] == pytest.approx(norm.item(), rel=1e-4)


def _nonfinite_worker(rank: int, init_file: str, out_dir: str) -> None:
    """ZeRO 2 over two ranks (gloo on the CPU, nccl on two GPUs); rank 1's first sample
    has a NaN advantage."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2")  # as torchrun
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    with spawned_rank(rank, 2, init_file, "nccl" if on_gpu else "gloo"):
        cfg = _cfg(zero_stage=2, max_tokens_per_gpu=9)  # [7] [5, 4] [4]: 3 micro-batches
        torch.manual_seed(0)
        train_engine = _train_engine(cfg, device)
        before = _params(train_engine)
        batch = _batch(cfg)
        if rank == 1:
            batch.advantages = torch.tensor([float("nan"), 1.0, 1.0, 1.0])
        skipped = float(update(train_engine, batch, cfg)["train/nonfinite_steps"])
        unchanged = torch.equal(before, _params(train_engine))
        applied = float(update(train_engine, _batch(cfg), cfg)["train/nonfinite_steps"])
        torch.save({"skipped": skipped, "unchanged": unchanged, "then_skipped": applied,
                    "moved": not torch.equal(before, _params(train_engine))},
                   f"{out_dir}/rank{rank}.pt")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="two ranks on a GPU machine need two GPUs")
def test_a_nonfinite_loss_on_one_rank_skips_the_step_on_all(tmp_path):
    """Finiteness is read once a step, after the micro-batches: the rank that saw a NaN loss
    and the one that did not both take the poisoning backward (under ZeRO 2 every backward
    reduces across ranks, so unequal counts would hang) and both skip the step."""
    import torch.multiprocessing as mp

    mp.spawn(_nonfinite_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["skipped"] == 1.0 and r["unchanged"]
        assert r["then_skipped"] == 0.0 and r["moved"]
