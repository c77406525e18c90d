"""The paper's configs planned for one workstation GPU (gpu_memory_gb 24, 40 and 48), at
the paper's per-GPU batch (32 prompts x 8 = 256 sequences, prompts up to 1,024 tokens,
responses up to 4,096): where AdamW's step cannot fit on the GPU the plan puts the
optimizer on the CPU (DeepSpeed's CPU Adam, under ZeRO 1 where it fits) and says so on
its first line; what cannot fit even so stops in one line. Sizes by hand (estimate.py's
module docstring)."""
from dataclasses import replace

import pytest

from minisparse.config.load import load_config
from minisparse.config.schema import ConfigError
from minisparse.models.loading import shape_config
from minisparse.trainer.memory.estimate import (GIB, backward_peak, host_memory, logprob_peak,
                                               setup_of, shape_of, step_peak)
from minisparse.trainer.memory.plan import make_plan, plan_zero_stage
from minisparse.trainer.memory.report import plan_table

PAPER = ["rollout_batch_size=32", "global_batch_size=64"]  # 256 sequences a GPU
HOST = 120 * GIB  # a 128 GB workstation's MemAvailable, about
SHAPES = {"qwen1.5b": "qwen2.5-1.5b", "qwen3b": "qwen2.5-3b"}
# the dense twins: qwen3b_dense ships; qwen1.5b's is qwen1.5b_rkv without compression
CONFIGS = {"qwen1.5b_rkv": ("qwen1.5b_rkv", []),
           "qwen1.5b_dense": ("qwen1.5b_rkv", ["compress.algorithm=none"]),
           "qwen3b_rkv": ("qwen3b_rkv", []), "qwen3b_dense": ("qwen3b_dense", [])}


@pytest.fixture(scope="module")
def shapes():
    return {k: shape_of(shape_config(v)) for k, v in SHAPES.items()}


def _setup(shapes, name, *overrides):
    config, extra = CONFIGS[name]
    cfg = load_config(config, [*PAPER, *extra, *overrides])
    return cfg, setup_of(cfg, shapes[name.split("_")[0]], 1, liger=True, reference=cfg.loss.kl_coef > 0)


def test_qwen1_5b_on_24gb_takes_cpu_adam_by_hand(shapes):
    """Qwen2.5-1.5B (P = 1,543,714,304; H 1536, 28 layers, I 8960, V 151,936, tied) at 24 GB,
    0.92 x 24 = 22.08 GiB planned for. AdamW's step on the GPU alone needs 22P =
    33,961,714,688 bytes (31.63 GiB). With CPU Adam under ZeRO 1 the GPU holds the weights
    2P (3,087,428,608), the gradients 2P, DeepSpeed's staging buffer for one gradient, the
    embedding's 2VH (466,747,392), and the bucket 1e9; the backward of 8,192 tokens starts
    with activations 8192 x 28 x 73,272 (a = 2(4H + 2Hq + 2Hkv + 3I) + 4(12 + 2);
    16,806,838,272) and the LM head's backward 2TH + 6VH + 2 x 1024 x V (1,736,572,928):
    26,185,015,808 bytes (24.39 GiB) without checkpointing; each layer checkpointed keeps
    8192 x 2H of its 8192 x a: 575,078,400 less; 4 layers 22.24 GiB, 5 layers 21.71. Its
    step: + the bucket and one gradient's fp32 copy 4VH (with the staging 8VH): 8.42 GiB.
    ZeRO 2 would fit without checkpointing (no gradients on the GPU: 20.58 GiB) but copy
    4P bytes over PCIe after every micro-batch. The host holds 20P + the reference model
    2P: 31.63 GiB. (The config's own 10,240-token micro-batches: 10 layers.)"""
    cfg, s = _setup(shapes, "qwen1.5b_rkv", "max_tokens_per_gpu=8192")
    p, vh = 1_543_714_304, 151_936 * 1536
    assert s.shape.params == p and 22 * p == 33_961_714_688
    plan = plan_zero_stage(cfg, s, 24 * GIB, "24 GB", host=HOST)
    assert plan.cpu_adam and plan.zero_stage == 1 and not plan.optimizer_offload
    assert plan.checkpointed_layers == 5 and plan.keep_state
    cpu = plan.setup
    assert cpu.cpu_adam and step_peak(s) == 22 * p  # (s: AdamW on the GPU, ZeRO 2)
    start = 4 * p + 2 * vh + 1_000_000_000 + 16_806_838_272 + 1_736_572_928
    assert backward_peak(cpu, 8192, 0, False) == start == 26_185_015_808
    assert plan.peaks["update"] == start - 5 * 575_078_400
    assert round((start - 4 * 575_078_400) / GIB, 2) == 22.24
    assert step_peak(cpu) == 4 * p + 8 * vh + 1_000_000_000 and round(step_peak(cpu) / GIB, 2) == 8.42
    two = replace(cpu, zero_stage=2)
    assert backward_peak(two, 8192, 0, False) == 22_097_587_200  # 2P + 2VH + start
    assert host_memory(cpu) == 22 * p
    # log-probs: weights, staging buffer, the visiting reference 2P, a layer's work
    # T x 2(3H + 3I) and the chunked head 2TH + 2 x 1024 x V: 6.98 GiB at 8,192 tokens;
    # the plan's 16,384 (auto) add 8192 x (2(3H + 3I) + 2H): 7.48 GiB
    assert logprob_peak(cpu, 8192) == 7_493_834_752
    assert plan.logprob_tokens == 16384
    assert plan.peaks["logprobs"] == logprob_peak(cpu, 16384) == 8_034_899_968
    head = plan_table(plan).splitlines()[0]
    assert head.endswith("optimizer on the CPU (DeepSpeed CPU Adam, auto: with AdamW on the GPU "
                         "the update would need ~31.6 GiB of the 22.1 GiB): host memory 31.6 "
                         "GiB a GPU of 120.0 available")
    assert ("ZeRO 1 (auto: with CPU Adam it moves the gradients to the CPU once a step, "
            "ZeRO 2 after every micro-batch)") in head
    assert "optimizer step 8.4, the step on the CPU" in plan_table(plan)
    assert plan.record()["cpu_adam"] and plan.record()["host_gib"] == pytest.approx(31.63, abs=0.01)


def test_qwen3b_on_48gb_takes_cpu_adam_by_hand(shapes):
    """Qwen2.5-3B (P = 3,085,938,688) at 48 GB, 44.16 GiB planned for: AdamW's step alone
    22P = 63.23 GiB; with CPU Adam under ZeRO 1 weights and gradients 2 x 2P
    (6,171,877,376 each) + 2VH (622,329,856) + the bucket 1e9 + activations 8192 x 36 x
    91,720 (27,049,328,640) + the head's backward (2,211,708,928) = 40.26 GiB, no
    checkpointing; the host 22P, 63.23 GiB (one process on a 128 GB host)."""
    cfg, s = _setup(shapes, "qwen3b_rkv")
    plan = plan_zero_stage(cfg, s, 48 * GIB, "48 GB", host=HOST)
    assert plan.cpu_adam and plan.zero_stage == 1 and not plan.gradient_checkpointing
    assert plan.peaks["update"] == (2 * 6_171_877_376 + 622_329_856 + 1_000_000_000
                                    + 27_049_328_640 + 2_211_708_928)
    assert round(plan.peaks["update"] / GIB, 2) == 40.26
    assert round(host_memory(plan.setup) / GIB, 2) == round(22 * 3_085_938_688 / GIB, 2) == 63.23
    # the same host with two GPUs' ranks on it (60 GiB each) cannot hold it: one line
    with pytest.raises(ConfigError) as info:
        plan_zero_stage(cfg, s, 48 * GIB, "48 GB", host=60 * GIB)
    assert str(info.value) == (
        "optimizer_offload=auto: the update needs ~63.2 GiB of the 44.2 GiB planned for on the "
        "GPU, and with the optimizer on the CPU (cpu_adam) ~63.2 GiB of host memory a GPU, 60.0 "
        "GiB available; use more GPUs or hosts")


# (config, GB) -> (CPU Adam, ZeRO stage, checkpointed layers): the update's choices do not
# depend on compression, so each dense twin plans as its R-KV config but for the rollout
@pytest.mark.parametrize("gb,model,cpu_adam,zero,layers", [
    (24, "qwen1.5b", True, 1, 10),  # 10,240-token micro-batches (8,192: 5 layers)
    (40, "qwen1.5b", False, 2, 12),  # AdamW fits on the GPU: 12 of 28 layers checkpointed
    (48, "qwen1.5b", False, 2, 1),  # (ZeRO 1 would checkpoint more)
    (24, "qwen3b", True, 1, 28),  # (ZeRO 2 would checkpoint 18, moving gradients each
    (40, "qwen3b", True, 1, 6),   # micro-batch: ZeRO 1 recomputes instead)
    (48, "qwen3b", True, 1, 0),
])
@pytest.mark.parametrize("rollout", ["rkv", "dense"])
def test_the_paper_configs_plan_on_24_40_and_48gb(shapes, gb, model, cpu_adam, zero, layers,
                                                  rollout):
    cfg, s = _setup(shapes, f"{model}_{rollout}")
    plan = plan_zero_stage(cfg, s, gb * GIB, f"{gb} GB", host=HOST)
    assert (plan.cpu_adam, plan.zero_stage) == (cpu_adam, zero)
    assert (plan.checkpointed_layers if plan.gradient_checkpointing else 0) == layers
    assert plan.peaks["update"] <= plan.usable and plan.peaks["logprobs"] <= plan.usable
    # (the rollout's pool is a share of what is free at the time, HEADROOM aside)
    assert plan.peaks["rollout"] <= gb * GIB
    if layers:  # the fewest that fit
        assert backward_peak(plan.setup, plan.update_tokens, layers - 1, False) > plan.usable
    if cpu_adam:  # nothing to swap: the rollout's pool gets the rest beside the weights
        assert plan.keep_state and "CPU Adam's gradient staging buffer" in plan_table(plan)
    elif rollout == "dense":  # dense KV (5,136 tokens x 256) leaves no room for the state
        assert not plan.keep_state


def test_what_cannot_fit_stops_in_one_line(shapes):
    """Qwen2.5-3B on 8 GB: even CPU Adam's step needs the weights 2P + 8VH (8.07 GiB) of
    the 7.36; a fixed optimizer_offload=false at 24 GB names cpu_adam as the fix; CPU Adam
    runs under ZeRO 1 or 2."""
    cfg, s = _setup(shapes, "qwen3b_rkv")
    with pytest.raises(ConfigError, match=r"^optimizer_offload=auto \(CPU Adam\): the optimizer "
                                          r"step alone needs ~8\.1 GiB of the 7\.4 GiB"):
        plan_zero_stage(cfg, s, 8 * GIB, "8 GB", host=HOST)
    cfg, s = _setup(shapes, "qwen1.5b_rkv", "optimizer_offload=false")
    with pytest.raises(ConfigError) as info:
        plan_zero_stage(cfg, s, 24 * GIB, "24 GB", host=HOST)
    assert str(info.value).endswith("set optimizer_offload=cpu_adam (the step on the CPU) or "
                                    "use more GPUs") and "\n" not in str(info.value)
    cfg, s = _setup(shapes, "qwen1.5b_rkv", "optimizer_offload=cpu_adam", "zero_stage=3")
    with pytest.raises(ConfigError, match="^optimizer_offload=cpu_adam runs under ZeRO 1 or 2, "
                                          "not zero_stage=3; set zero_stage=1, 2 or auto$"):
        make_plan(cfg, s, 24 * GIB, "24 GB")
    # set, where AdamW would fit on the GPU: it is taken, and said so
    cfg, s = _setup(shapes, "qwen1.5b_rkv", "optimizer_offload=cpu_adam")
    plan = plan_zero_stage(cfg, s, 80 * GIB, "80 GB", host=HOST)
    assert plan.cpu_adam and "(DeepSpeed CPU Adam, optimizer_offload=cpu_adam)" in plan_table(plan)


def test_gpu_memory_gb_caps_the_process(monkeypatch):
    """gpu_memory_gb on a GPU sets torch's per-process memory fraction (24 of 80 GiB: 0.3),
    and the KV pool is sized from what the cap leaves, not from the GPU's free memory."""
    import types

    import torch

    from minisparse.engine.kv_pool import cuda_free
    from minisparse.trainer.memory.plan import cap_gpu_memory

    cuda = torch.cuda
    set_to = {}
    monkeypatch.setattr(cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setattr(cuda, "set_per_process_memory_fraction",
                        lambda fraction, device: set_to.update(fraction=fraction))
    cap_gpu_memory(load_config("tiny_rkv", ["gpu_memory_gb=24"]), torch.device("cuda", 0))
    assert set_to == {"fraction": 0.3}
    cap_gpu_memory(load_config("tiny_rkv"), torch.device("cuda", 0))  # 0: no cap
    cap_gpu_memory(load_config("tiny_rkv", ["gpu_memory_gb=24"]), torch.device("cpu"))
    assert set_to == {"fraction": 0.3}
    # 70 GiB free on the GPU, 10 reserved by this process under a 24 GiB cap: 14 GiB
    monkeypatch.setattr(cuda, "mem_get_info", lambda device: (70 * GIB, 80 * GIB))
    monkeypatch.setattr(cuda, "memory_reserved", lambda device: 10 * GIB)
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda device: 0.3)
    assert cuda_free(torch.device("cuda", 0)) == 14 * GIB
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda device: 1.0)
    assert cuda_free(torch.device("cuda", 0)) == 70 * GIB


def test_the_pool_is_sized_on_a_device_named_without_an_index(monkeypatch):
    """eval.py's engine runs on "cuda": torch's per-process memory fraction refuses a
    device without an index (seen on a GPU: every eval.py run stopped there), so the
    current device's index is used."""
    import torch

    from minisparse.engine.kv_pool import cuda_free

    cuda, asked = torch.cuda, []

    def fraction(device):
        if device.index is None:  # what torch 2.11 raises
            raise ValueError("Expected a torch.device with a specified index")
        asked.append(device)
        return 1.0
    monkeypatch.setattr(cuda, "current_device", lambda: 2)
    monkeypatch.setattr(cuda, "mem_get_info", lambda device: (70 * GIB, 80 * GIB))
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", fraction)
    assert cuda_free(torch.device("cuda")) == 70 * GIB
    assert asked == [torch.device("cuda", 2)]
