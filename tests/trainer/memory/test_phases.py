"""The phase switches (trainer/memory/phases.py): what moves between the rollout engine
and the trainer, and the reference model's visit to the GPU."""
import os

import pytest
import torch

from minisparse.config.schema import Config
from minisparse.trainer.memory.phases import rollout_memory, train_memory
from scripts.ports import free_ports


def test_a_kept_state_moves_nothing_but_the_pool():
    """With keep_state the swaps leave the optimizer state alone; the engine still sleeps
    and wakes (its pool is freed for the update and sized afresh for the rollout)."""
    calls = []

    class Recorder:
        def __getattr__(self, name):
            return lambda: calls.append(name)

    for keep in (True, False):
        calls.clear()
        rollout_memory(Recorder(), Recorder(), torch.device("cpu"), keep_state=keep)
        train_memory(Recorder(), Recorder(), torch.device("cpu"))
        assert calls == (["wake", "sleep", "reload"] if keep else
                         ["offload", "wake", "sleep", "reload"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload moves GPU state")
@pytest.mark.parametrize("stage", [1, 2])
def test_state_offload_roundtrip_on_gpu(stage):
    from policy_models import tiny_qwen2

    from minisparse.utils.distributed import init_distributed
    from minisparse.trainer.memory.phases import TrainingStateOffload
    from minisparse.trainer.train_engine import build_train_engine

    os.environ.setdefault("MASTER_PORT", str(free_ports()))
    device = init_distributed()
    cfg = Config(zero_stage=stage)
    model = tiny_qwen2(vocab=64, hidden=32, layers=1, heads=2, kv_heads=1).to(device)
    train_engine = build_train_engine(model, cfg, 10, device)

    def step():
        loss = train_engine(torch.arange(8, device=device)[None]).logits.float().pow(2).mean()
        train_engine.backward(loss, scale_wrt_gas=False)
        train_engine.step()

    step()  # creates the AdamW moments
    states = lambda: [
        v
        for _, st in train_engine.optimizer.optimizer.state.items()
        for v in st.values()
        if torch.is_tensor(v) and v.numel() > 1
    ]
    before = [v.clone() for v in states()]
    offload = TrainingStateOffload(train_engine)
    for _ in range(2):
        offload.offload()
        assert all(v.device.type == "cpu" and v.is_pinned() for v in states())
        offload.reload()
        assert all(v.device.type == "cuda" for v in states())
        for a, b in zip(before, states()):
            torch.testing.assert_close(a, b)
    step()  # training goes on after the round trips
    assert train_engine.was_step_applied()
    # The process group stays up: DeepSpeed keeps its groups for the process, so the next
    # stage's DeepSpeed engine, built on a new group, would find the old ones destroyed.


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_visiting_moves_in_and_home_without_copying_back():
    from minisparse.trainer.memory.phases import visiting

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


def test_swaps_merge_lora_weights_before_the_pool_and_free_them_for_training():
    """Under LoRA the engine samples with the merged weights: made before the KV pool is
    allocated (its share is sized from what is free then), freed once the pool is released;
    without LoRA it samples with the policy itself."""
    pytest.importorskip("peft")
    from types import SimpleNamespace

    from policy_models import tiny_qwen2

    from minisparse.config.schema import LoraConfig
    from minisparse.models.lora import apply_lora
    from minisparse.trainer.memory.phases import Swaps

    def train_engine(module):
        return SimpleNamespace(module=module, zero_optimization_stage=lambda: 2,
                               zero_cpu_offload=lambda: False)

    policy = tiny_qwen2(vocab=50, hidden=16, layers=1, heads=2, kv_heads=1)
    apply_lora(policy, LoraConfig(enabled=True, rank=2, alpha=4.0))
    swaps = Swaps(train_engine(policy), torch.device("cpu"), keep_state=False)
    calls = []

    class Rollout:
        def wake(self):
            calls.append(("wake", swaps.merged.merged_bytes > 0))

        def sleep(self):
            calls.append(("sleep", swaps.merged.merged_bytes > 0))

        def update_weights(self, model):
            calls.append(("weights", model is swaps.merged.model))

    swaps.to_rollout(Rollout())
    with swaps.sampling(Rollout()):
        pass
    swaps.to_training(Rollout())
    assert calls == [("wake", True), ("weights", True), ("sleep", True)]
    assert swaps.merged.merged_bytes == 0
    plain = Swaps(train_engine(tiny_qwen2(vocab=50, hidden=16, layers=1, heads=2, kv_heads=1)),
                  torch.device("cpu"), keep_state=False)
    assert plain.merged is None and plain.sampled_model() is plain.train_engine.module
