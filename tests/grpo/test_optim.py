import pytest
import torch

from minisparse.config.schema import Config
from minisparse.grpo.optim import deepspeed_config, lr_factor, param_groups


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


def test_overlap_comm_only_where_there_is_a_reduction_to_overlap():
    """DeepSpeed refuses overlap_comm with unmanaged accumulation below stage 2, and one
    rank has nothing to reduce: either way the stage a user picks must start."""
    def overlap(stage: int, world: int, on_gpu: bool = True) -> bool:
        return deepspeed_config(Config(zero_stage=stage), on_gpu, world)["zero_optimization"][
            "overlap_comm"]

    assert overlap(2, 4) and overlap(3, 2)
    assert not overlap(2, 1) and not overlap(1, 4) and not overlap(0, 4)
    assert not overlap(2, 4, on_gpu=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload moves GPU state")
def test_state_offload_roundtrip_on_gpu():
    import os
    import socket

    from grpo_models import tiny_qwen2

    from minisparse.grpo.distributed import init_distributed
    from minisparse.grpo.optim import TrainingStateOffload, build_train_engine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    device = init_distributed()
    cfg = Config(zero_stage=2)
    model = tiny_qwen2(vocab=64, hidden=32, layers=1, heads=2, kv_heads=1).to(device)
    engine = build_train_engine(model, cfg, 10, device)

    def step():
        loss = engine(torch.arange(8, device=device)[None]).logits.float().pow(2).mean()
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()

    step()  # creates the AdamW moments
    states = lambda: [
        v
        for _, st in engine.optimizer.optimizer.state.items()
        for v in st.values()
        if torch.is_tensor(v) and v.numel() > 1
    ]
    before = [v.clone() for v in states()]
    offload = TrainingStateOffload(engine)
    for _ in range(2):
        offload.offload()
        assert all(v.device.type == "cpu" and v.is_pinned() for v in states())
        offload.reload()
        assert all(v.device.type == "cuda" for v in states())
        for a, b in zip(before, states()):
            torch.testing.assert_close(a, b)
    step()  # training goes on after the round trips
    assert engine.was_step_applied()
    torch.distributed.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_visiting_moves_in_and_home_without_copying_back():
    from minisparse.grpo.memory import visiting

    model = torch.nn.Linear(8, 4)
    model.weight.data = model.weight.data.pin_memory()
    before = model.weight.data.clone()
    home = model.weight.data.data_ptr()
    x = torch.randn(3, 8)
    with visiting(model, torch.device("cuda")) as m:
        assert m.weight.is_cuda and m.bias.is_cuda
        y = m(x.cuda()).cpu()
    assert not model.weight.is_cuda and model.weight.data.data_ptr() == home
    torch.testing.assert_close(model.weight.data, before)
    torch.testing.assert_close(y, model(x))
