"""The memory plan with LoRA (model.lora): the optimizer state and gradients are the
adapters' (counted by hand and by PEFT itself), no reference copy, the merged weights in
the rollout; qwen3b_rkv plans on a 24 GB GPU with LoRA, where full training cannot."""
import pytest
import torch

from minisparse.config.load import load_config
from minisparse.config.schema import ConfigError, LoraConfig
from minisparse.trainer.memory.estimate import (gradients, head_backward, logprob_peak,
                                               lora_sizes, optimizer_state,
                                               rollout_resident, setup_of, step_peak, weights)
from minisparse.trainer.memory.plan import plan_memory
from minisparse.trainer.memory.report import plan_table

# the paper's per-GPU batch on one GPU: 32 prompts x 8 samples (128 x 8 over 4 GPUs)
ONE_GPU = ["model.path=qwen2.5-3b", "gpu_memory_gb=24", "rollout_batch_size=32",
           "global_batch_size=64"]
# Qwen2.5-3B, rank 16 on every linear layer of its 36 decoder layers: rank x (in + out) =
# 16 x (q 2048+2048, k 2048+256, v 2048+256, o 2048+2048, gate 2048+11008, up 2048+11008,
# down 11008+2048) = 16 x 51,968 = 831,488 a layer
ADAPTERS = 36 * 831_488  # 29,933,568
# the weights they adapt: 2048 x (2048 + 256 + 256 + 2048 + 3 x 11008) a layer
ADAPTED = 36 * 2048 * (2048 + 256 + 256 + 2048 + 3 * 11008)


def test_adapter_count_by_hand_and_by_peft(qwen3b):
    from minisparse.models.loading import build_shape_model
    from minisparse.models.lora import apply_lora, trainable_parameters

    assert lora_sizes(qwen3b, LoraConfig(rank=16)) == (ADAPTERS, ADAPTED)
    model = apply_lora(build_shape_model("qwen2.5-3b", device="meta"), LoraConfig(rank=16))
    assert trainable_parameters(model) == ADAPTERS
    adapted = sum(m.get_base_layer().weight.numel() for m in model.modules()
                  if hasattr(m, "get_base_layer") and hasattr(m, "lora_A"))
    assert adapted == ADAPTED
    assert lora_sizes(qwen3b, LoraConfig(rank=8, target_modules=["q_proj", "v_proj"])) == (
        36 * 8 * (2048 + 2048 + 2048 + 256), 36 * 2048 * (2048 + 256))


def test_qwen3b_rkv_with_lora_plans_on_24gb_where_full_training_cannot(qwen3b):
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="~63.2 GiB"):  # its optimizer step
        plan_memory(load_config("qwen3b_rkv", ONE_GPU), cpu, 1, reference=True)
    cfg = load_config("qwen3b_rkv", [*ONE_GPU, "model.lora.enabled=true"])
    plan = plan_memory(cfg, cpu, 1, reference=cfg.loss.kl_coef > 0)
    s = plan.setup
    assert (s.trainable, s.merged, s.reference) == (ADAPTERS, ADAPTED, False)
    assert s.zero_stage == 2 and not plan.optimizer_offload
    # only the adapters' optimizer state and gradients: fp32 masters 4 + moments 8 bytes,
    # bf16 gradients 2 bytes a trained parameter (ZeRO 2 on one GPU)
    assert optimizer_state(s) == 12 * ADAPTERS == 359_202_816
    assert gradients(s) == 2 * ADAPTERS == 59_867_136
    # base + adapters in bf16; the step adds the flat bf16 copy and fp32 gradients
    assert weights(s) == 2 * (qwen3b.params + ADAPTERS)
    assert step_peak(s) == weights(s) + 20 * ADAPTERS
    # the rollout also holds the merged copy of the adapted weights
    assert rollout_resident(s) == 2 * (qwen3b.params + ADAPTERS + ADAPTED)
    # no LM-head gradient (frozen): its saved input and one chunk's logits
    assert head_backward(s, 8192) == 2 * 8192 * 2048 + 2 * 1024 * 151_936
    assert all(plan.peaks[p] <= plan.usable for p in ("logprobs", "update"))
    assert "(LoRA: 29.9M trained)" in plan_table(plan)
    full = setup_of(load_config("qwen3b_rkv", ONE_GPU), qwen3b, 1, False, True)
    # the reference model no longer visits: log-probs need the policy's weights alone
    assert logprob_peak(full, 8192) - logprob_peak(s, 8192) == (
        2 * qwen3b.params + optimizer_state(full) - optimizer_state(s) - 2 * ADAPTERS)
