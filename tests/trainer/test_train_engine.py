import os

import pytest
import torch
from spawned_ranks import spawned_rank

from minisparse.config.schema import Config
from minisparse.trainer.train_engine import deepspeed_config, lr_factor, param_groups


def _cfg(schedule, warmup=0, min_lr=0.0):
    cfg = Config()
    cfg.optim.lr, cfg.optim.lr_schedule, cfg.optim.warmup_steps, cfg.optim.min_lr = (
        1.0,
        schedule,
        warmup,
        min_lr,
    )
    return cfg


def test_lr_schedules():
    assert [lr_factor(s, _cfg("constant", warmup=4), 100) for s in (0, 3, 4, 50)] == [
        0.25,
        1.0,
        1.0,
        1.0,
    ]
    cos = _cfg("cosine", min_lr=0.1)
    assert lr_factor(0, cos, 10) == pytest.approx(1.0)
    assert lr_factor(5, cos, 10) == pytest.approx(0.55)  # halfway: (1 + 0.1) / 2
    assert lr_factor(10, cos, 10) == pytest.approx(0.1)
    assert lr_factor(2, _cfg("linear", warmup=2), 12) == pytest.approx(1.0)
    assert lr_factor(7, _cfg("linear", warmup=2), 12) == pytest.approx(0.5)


def test_no_decay_on_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    groups = param_groups(model, 0.1)
    assert [len(g["params"]) for g in groups] == [1, 3]  # weight | bias, ln weight, ln bias
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]


def test_deepspeed_config_follows_cfg():
    cfg = Config(zero_stage=3)
    cfg.optim.grad_clip = 0.5
    ds = deepspeed_config(cfg, on_gpu=True)
    assert ds["zero_optimization"]["stage"] == 3 and ds["gradient_clipping"] == 0.5
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["managed_gradient_accumulation"] is False
    # zero_stage=auto that no memory plan resolved (train.py writes the plan's choice)
    auto = deepspeed_config(Config(), on_gpu=True, world=2)["zero_optimization"]
    assert (auto["stage"], auto["overlap_comm"]) == (2, True)


def test_overlap_comm_only_where_there_is_a_reduction_to_overlap():
    """DeepSpeed refuses overlap_comm with unmanaged accumulation below stage 2, and one
    rank has nothing to reduce: either way the stage a user picks must start."""
    def overlap(stage: int, world: int, on_gpu: bool = True) -> bool:
        return deepspeed_config(Config(zero_stage=stage), on_gpu, world)["zero_optimization"][
            "overlap_comm"]

    assert overlap(2, 4) and overlap(3, 2)
    assert not overlap(2, 1) and not overlap(1, 4) and not overlap(0, 4)
    assert not overlap(2, 4, on_gpu=False)


def _zero_worker(rank: int, init_file: str, stage: int, out_dir: str) -> None:
    """Two optimizer steps of 3 micro-batches each (different tokens on each rank),
    counting the all-reduces DeepSpeed makes before each step."""
    import torch.distributed as tdist
    from transformers import AutoModelForCausalLM, Qwen2Config

    from minisparse.config.load import load_config
    from minisparse.trainer.train_engine import build_train_engine

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2")  # as torchrun
    with spawned_rank(rank, 2, init_file):
        cfg = load_config("tiny_rkv", [f"zero_stage={stage}", "optim.lr=1e-2",
                                       "model.dtype=float32"])
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False),
            dtype=torch.float32)
        engine = build_train_engine(model, cfg, 10, torch.device("cpu"))
        start = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
        calls, plain = [], tdist.all_reduce
        tdist.all_reduce = lambda *a, **k: calls.append(1) or plain(*a, **k)
        before_step = []
        tokens = torch.Generator().manual_seed(100 + rank)
        for _ in range(2):
            for _ in range(3):
                ids = torch.randint(0, 256, (1, 24), generator=tokens)
                loss = engine.module(input_ids=ids).logits.square().mean()
                engine.backward(loss, scale_wrt_gas=False)
                before_step.append(len(calls))
            engine.step()
        tdist.all_reduce = plain
        weights = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
        torch.save({"start": start, "weights": weights, "before_step": before_step},
                   f"{out_dir}/zero{stage}_rank{rank}.pt")


def test_zero_1_and_2_train_alike_and_differ_in_when_they_reduce(tmp_path):
    """With our unmanaged gradient accumulation (a backward per micro-batch, a step per
    optimizer step), ZeRO 2 reduces the gradients across ranks after every micro-batch and
    ZeRO 1 once, at the step: the same weights for 2/3 of the reductions fewer here. On
    several GPUs that per-micro-batch reduction is what a 3B update pays over one GPU's
    same work (docs/benchmarks.md)."""
    import torch.multiprocessing as mp

    results = {}
    for stage in (1, 2):
        init = tmp_path / f"init{stage}"
        mp.spawn(_zero_worker, args=(str(init), stage, str(tmp_path)), nprocs=2)
        results[stage] = [torch.load(tmp_path / f"zero{stage}_rank{r}.pt") for r in (0, 1)]
    for stage in (1, 2):  # both ranks hold the same weights after the steps
        torch.testing.assert_close(results[stage][0]["weights"], results[stage][1]["weights"])
    torch.testing.assert_close(results[1][0]["weights"], results[2][0]["weights"],
                               rtol=0, atol=1e-4)
    for stage in (1, 2):  # the two steps moved the weights (lr 1e-2)
        moved = results[stage][0]["weights"] - results[stage][0]["start"]
        assert moved.abs().max() > 1e-3
    # all-reduces made by the end of each micro-batch's backward: none for ZeRO 1 until its
    # step, one per micro-batch for ZeRO 2 (this small model's gradients fill one bucket)
    zero1, zero2 = results[1][0]["before_step"], results[2][0]["before_step"]
    assert zero1[:3] == [0, 0, 0] and zero1[3] == zero1[4] == zero1[5]
    assert zero2[:3] == [1, 2, 3] and zero2[4] - zero2[3] == zero2[5] - zero2[4] == 1
