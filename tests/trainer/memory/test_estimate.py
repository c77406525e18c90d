"""What each phase needs (trainer/memory/estimate.py): activation sizes against what
autograd really saves, and the sizes of Qwen2.5-3B and 7B computed by hand."""
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from memory_setups import zero2_setup
from minisparse.models.attention import packing_kwargs, use_attention
from minisparse.models.checkpointing import checkpoint_layers, checkpointed_count
from minisparse.models.liger import liger_available, use_liger_kernel
from minisparse.models.loading import shape_config
from minisparse.config.load import load_config
from minisparse.engine.kv_pool import pool_bytes
from minisparse.trainer.memory.estimate import (CPU_ALLOCATOR, CPU_LIBRARIES, GIB, ModelShape,
                                                activations, backward_peak, cpu_peak,
                                                first_flush_share, gradient_buckets,
                                                per_token_layer, setup_of, shape_of, step_peak)
from minisparse.trainer.memory.plan import not_planned
from minisparse.trainer.memory.report import cpu_memory_line


SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=704, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=4096)


def _saved_bytes(config, tokens: int, dtype: torch.dtype, checkpointed: int | None,
                 device: str = "cpu", liger: bool = False) -> int:
    """Bytes autograd saves for the backward of a decoder (weights aside), one packed row
    and the varlen attention as in training, with the first `checkpointed` layers under
    gradient checkpointing (None: all)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    use_attention(model, "varlen")
    if liger:
        use_liger_kernel(model, "on", on_gpu=True)
    checkpoint_layers(model, checkpointed)
    model.train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, 512, (1, tokens), device=device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=ids, position_ids=torch.arange(tokens, device=device)[None],
                    use_cache=False, **packing_kwargs([tokens], ids.device))
    return sum(saved.values())


def _per_token_layer(make_config, dtype, checkpointing, tokens=(256, 512), **kw) -> float:
    """Saved bytes of one token in one layer: the second layer and the second block of
    tokens isolate it from the embedding, the final norm and fixed-size buffers."""
    layers = None if checkpointing else 0
    layer = [_saved_bytes(make_config(2), n, dtype, layers, **kw)
             - _saved_bytes(make_config(1), n, dtype, layers, **kw) for n in tokens]
    return (layer[1] - layer[0]) / (tokens[1] - tokens[0])


@pytest.mark.parametrize("dtype,b", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_activation_formula_is_what_autograd_saves(dtype, b):
    """PyTorch ops: b(4H + 2Hq + 2Hkv + 4I) + 8H + 4(heads + 2), with H = Hq = 256,
    Hkv = 64, I = 704, 8 heads: bf16 2*(1024 + 512 + 128 + 2816) + 2048 + 40 = 11,048."""
    cfg = load_config("tiny_rkv", [f"model.dtype={'float32' if b == 4 else 'bfloat16'}"])
    s = setup_of(cfg, shape_of(Qwen2Config(num_hidden_layers=1, **SMALL)), 1, liger=False, reference=cfg.loss.kl_coef > 0)
    make = lambda layers: Qwen2Config(num_hidden_layers=layers, **SMALL)  # noqa: E731
    assert _per_token_layer(make, dtype, False) == per_token_layer(s) == (
        20_008 if b == 4 else 11_048)
    # with checkpointing a layer keeps its input only; one recomputed layer comes on top
    # for the whole stack (T·a)
    assert _per_token_layer(make, dtype, True) == b * 256
    assert activations(s, 512, 1) - activations(s, 256, 1) == 256 * (
        b * 256 + per_token_layer(s))


def test_checkpointing_some_layers_saves_what_the_formula_says():
    """Three layers, the first one checkpointed: it keeps b·H a token instead of a, and no
    recomputed layer comes on top (its recompute follows the other layers' backward);
    gradients are those of the run without checkpointing."""
    cfg = load_config("tiny_rkv")
    config = Qwen2Config(num_hidden_layers=3, **SMALL)
    s = setup_of(cfg, shape_of(config), 1, liger=False, reference=cfg.loss.kl_coef > 0)
    per_token = [(_saved_bytes(config, 512, torch.float32, c)
                  - _saved_bytes(config, 256, torch.float32, c)) / 256 for c in (0, 1)]
    assert per_token[0] - per_token[1] == per_token_layer(s) - 4 * 256
    assert activations(s, 256, 0) - activations(s, 256, 1) == 256 * (per_token_layer(s) - 4 * 256)

    grads = []
    for count in (0, 1, None):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        checkpoint_layers(model, count)
        assert checkpointed_count(model) == {0: 0, 1: 1, None: 3}[count]
        model.train()
        ids = torch.randint(0, 512, (1, 40))
        model(input_ids=ids).logits.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0])
    torch.testing.assert_close(grads[2], grads[0])
    with pytest.raises(ValueError, match="4 checkpointed layers asked of a model with 3"):
        checkpoint_layers(model, 4)


@pytest.mark.skipif(not torch.cuda.is_available() or not liger_available(),
                    reason="needs CUDA and liger-kernel")
def test_liger_activation_formula_on_the_gpu():
    """Liger's RMSNorm, SwiGLU and RoPE with torch's varlen flash kernel, Qwen2.5-3B's
    layer: b(4H + 2Hq + 2Hkv + 3I) + 4(heads + 2) = 91,720 bytes (so on an H100 80GB)."""
    make = lambda layers: shape_config("qwen2.5-3b", num_hidden_layers=layers)  # noqa: E731
    s = setup_of(load_config("qwen3b_rkv"), shape_of(make(1)), 1, liger=True, reference=True)
    assert _per_token_layer(make, torch.bfloat16, False, tokens=(2048, 4096), device="cuda",
                            liger=True) == per_token_layer(s) == 91_720


def test_qwen3b_sizes_by_hand(qwen3b):
    """P = 3,085,938,688 (tied embedding once). Liger layer, H = Hq = 2048, Hkv = 256,
    I = 11008, 16 heads: a = 2(8192 + 4096 + 512 + 33024) + 72 = 91,720 bytes (measured on
    an H100 with saved-tensor hooks: 91,720). Optimizer step under ZeRO 2 on one GPU:
    2P weights + 4P master + 8P AdamW + 2P gradients + 2P flat copy + 4P fp32 = 22P =
    67,890,651,136 bytes = 63.23 GiB (63.30 measured); with 4 GPUs 2P + 20P/4 = 7P."""
    _, s = zero2_setup(qwen3b)
    assert qwen3b.params == 3_085_938_688 and qwen3b.layer_params == 77_070_336
    assert per_token_layer(s) == 91_720
    assert step_peak(s) == 22 * qwen3b.params == 67_890_651_136
    assert step_peak(zero2_setup(qwen3b, world=4)[1]) == 7 * qwen3b.params
    # the first step makes the AdamW moments after the flat copy is freed: 20P (57.55 measured)
    assert step_peak(s, adam=False) == 20 * qwen3b.params
    # one 8,352-token sequence, no checkpointing: 8352 x 36 x 91,720 = 27,577,635,840 bytes
    assert activations(s, 8352, False) == 27_577_635_840


def test_qwen7b_on_two_gpus_by_hand():
    """Qwen2.5-7B (P = 7,614,699,008, LM head untied: V x H = 544,538,624 elements) under
    ZeRO 2 on two GPUs, 8,192-token micro-batches, no checkpointing. The head's gradient is
    the backward's first and alone fills DeepSpeed's 5e8-element bucket, so the first flush
    comes before any layer's activations are freed; with two ranks DeepSpeed overlaps the
    reduction and double-buffers the bucket. State 2P + 12P/2 (56.73 GiB) + the previous
    micro-batch's gradients P (7.09) + activations 8192 x 28 x 158,840 (33.93) + the new
    partition (7.09) + two buckets of 1e9 bytes (1.86) + the head's gradient 2VH (1.01) +
    one layer's work 8192 x 2 x (18944 + 7168) (0.40) = 108.12 GiB: measured 107.91 on two
    H200s (was planned 104.6 when the first flush was taken to free 2.15 layers and one
    bucket was counted)."""
    cfg = load_config("qwen7b_rkv", ["data.max_prompt_len=160", "rollout_batch_size=64",
                                     "global_batch_size=128"])
    m = shape_of(shape_config("qwen2.5-7b"))
    s = setup_of(cfg, m, 2, liger=True, reference=cfg.loss.kl_coef > 0)
    assert (m.params, m.tied, m.vocab * m.hidden) == (7_614_699_008, False, 544_538_624)
    assert per_token_layer(s) == 158_840 and first_flush_share(s) == 0
    assert gradient_buckets(s) == 2 and gradient_buckets(setup_of(cfg, m, 1, True, cfg.loss.kl_coef > 0)) == 1
    assert backward_peak(s, 8192, 0, False) == 116_097_970_176
    assert round(backward_peak(s, 8192, 0, False) / GIB, 2) == 108.12
    # a tied head (Qwen2.5-3B) comes last: 5e8 / (36 x 77,070,336) of the layers are done
    _, s3 = zero2_setup(shape_of(shape_config("qwen2.5-3b")))
    assert round(first_flush_share(s3), 4) == 0.1802


# SmolLM2-135M-Instruct's shape (its config.json): tied embeddings, 134,515,008 parameters.
SMOLLM2 = ModelShape(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64,
                     intermediate=1536, vocab=49152, params=134_515_008)


def test_the_cpu_quick_starts_peak_by_hand():
    """smollm2_cpu: float32 without ZeRO, 512-token micro-batches. Weights 4P = 538,060,032,
    AdamW's moments 8P = 1,076,120,064, gradients 4P = 538,060,032; activations 512 tokens
    x 30 layers x 44,588 bytes (4(4H + 2Hq + 2Hkv + 4I) + 8H + 4(heads + 2)) =
    684,871,680; the fused LM head's backward 4TH + 8VH + 4TV = 328,335,360. The update's
    3,165,447,168 bytes, + 20% for the allocator and 0.6 GiB of libraries: 4.14 GiB
    (4.1-4.3 GiB measured, docs/memory.md)."""
    cfg = load_config("smollm2_cpu")
    s = setup_of(cfg, SMOLLM2, 1, liger=False, reference=False)
    assert (s.zero_stage, s.worst_tokens) == (0, 512)
    pool = pool_bytes(cfg.engine, torch.device("cpu"))
    assert pool == int(0.8 * 0.5 * GIB)
    peak, phase = cpu_peak(s, 0, pool)
    assert phase == "update"
    assert peak == CPU_LIBRARIES + int(3_165_447_168 * (1 + CPU_ALLOCATOR))
    assert round(peak / GIB, 2) == 4.14
    # the settings it had: ZeRO 2 (fp32 masters, gradient partition and bucket) and
    # 2,048-token micro-batches (7.83 GiB measured)
    before = setup_of(load_config("smollm2_cpu", ["zero_stage=2", "max_tokens_per_gpu=2048"]),
                      SMOLLM2, 1, liger=False, reference=False)
    assert cpu_peak(before, 0, pool)[0] > 1.6 * peak
    # every layer checkpointed: one layer's activations and each layer's input instead
    assert cpu_peak(s, 30, pool)[0] < peak


def test_a_cpu_run_names_its_peak_phase_and_what_lowers_it():
    cfg = load_config("tiny_rkv", ["model.path=qwen2.5-1.5b"])
    line = cpu_memory_line(cfg, not_planned(cfg), 1, reference=True)
    assert re.fullmatch(r"memory: about \d+\.\d GiB resident at its peak, in the update \(a "
                        r"smaller max_tokens_per_gpu or model.gradient_checkpointing=true "
                        r"lowers it\)", line), line
    checkpointed = load_config("tiny_rkv", ["model.path=qwen2.5-1.5b",
                                            "model.gradient_checkpointing=true"])
    assert cpu_memory_line(checkpointed, not_planned(checkpointed), 1, True).endswith(
        "in the update (a smaller max_tokens_per_gpu lowers it)")
    tiny = load_config("tiny_rkv", ["engine.kv_cpu_memory_gb=4"])
    assert cpu_memory_line(tiny, not_planned(tiny), 2, True).endswith(
        "resident at its peak a process, in the rollout (a smaller engine.kv_cpu_memory_gb "
        "lowers it)")
