"""The memory plan (trainer/memory/plan.py): the decisions for Qwen2.5-3B on an 80 GB GPU
at 4k, 8k and 16k-token responses computed by hand, the ZeRO stage under auto, one-line
stops for settings that cannot fit, planned peaks beside measured ones, and train.py
stopping before any model loads."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from memory_setups import H100, zero2_setup
from minisparse.config.load import load_config
from minisparse.config.schema import ConfigError
from minisparse.models.loading import shape_config
from minisparse.trainer.memory.estimate import (GIB, backward_peak, gradient_buckets, gradients,
                                               head_backward, kv_tokens, logprob_peak,
                                               reduction_bucket, rollout_kv_need, setup_of,
                                               shape_of, step_peak, training_state)
from minisparse.trainer.memory.report import comparison_line, plan_table
from minisparse.trainer.memory.plan import (_logprob_budget, batch_peaks,
                                           gpu_capacity, make_plan, not_planned, plan_errors,
                                           plan_zero_stage)

REPO = Path(__file__).resolve().parents[3]


def test_zero_1_by_hand(qwen3b):
    """qwen3b_rkv under ZeRO 1 (what zero_stage=auto picks here) on an 80 GB GPU at 4k, 8,192-token micro-batches:
    the gradients accumulate in the parameters' .grad and meet DeepSpeed's bucket only at
    the step, so the backward's peak is its start: state 14P (43,203,141,632) + gradients
    2P (6,171,877,376) + activations 8192 x 36 x 91,720 (27,049,328,640) + the LM head's
    backward 2 x 8192 x 2048 + 6 x 151,936 x 2048 + 2 x 1024 x 151,936 (2,211,708,928) + the
    bucket 2 x 5e8 (made by the first backward's gradient hooks; measured +1.0 GiB over the
    estimate without it, one H200) = 79,636,056,576 bytes, 74.17 GiB. Each checkpointed
    layer keeps 8192 x 2 x 2048 of its 8192 x 91,720: 2 layers 72.83, 3 layers 72.16 GiB of
    the 72.68 planned for."""
    cfg = load_config("qwen3b_rkv", ["data.max_prompt_len=160", "zero_stage=1"])
    s = setup_of(cfg, qwen3b, 1, liger=True, reference=cfg.loss.kl_coef > 0)
    assert s.zero_stage == 1 and reduction_bucket(s) == 1_000_000_000
    assert head_backward(s, 8192) == 2_211_708_928
    assert backward_peak(s, 8192, 0, False) == 79_636_056_576
    assert backward_peak(s, 8192, 2, False) == 79_636_056_576 - 2 * 8192 * (91_720 - 4096)
    plan = make_plan(cfg, s, H100, "H100")
    assert plan.checkpointed_layers == 3 and not plan.optimizer_offload and plan.keep_state
    assert round(plan.peaks["update"] / GIB, 2) == 72.16
    # one GPU: the same training state as ZeRO 2 (its gradient partition is every gradient)
    assert training_state(s) == training_state(zero2_setup(qwen3b)[1]) == 14 * qwen3b.params
    # several GPUs: every gradient on each, the reduction once a step
    four = setup_of(cfg, qwen3b, 4, liger=True, reference=cfg.loss.kl_coef > 0)
    assert gradients(four) == 2 * qwen3b.params and gradient_buckets(four) == 1


@pytest.mark.parametrize("world,response,zero_2,zero_1", [
    (4, 4096, 7, 14), (4, 8192, 9, 15), (4, 16384, 19, 22),
    (8, 4096, 0, 4), (8, 8192, 0, 7), (8, 16384, 13, 18)])
def test_zero_stage_auto_keeps_qwen7b_on_zero_2_on_80gb_gpus(world, response, zero_2, zero_1):
    """On 4-8 GPUs of 80 GB, ZeRO 1's every-gradient copy (15.2 GB a GPU) would cost
    Qwen2.5-7B checkpointed layers: zero_stage=auto takes ZeRO 2 and says what 1 would
    cost."""
    m = shape_of(shape_config("qwen2.5-7b"))
    shape = [f"max_response_len={response}", f"rollout_batch_size={32 * world}",
             f"global_batch_size={64 * world}"]
    layers = {}
    for stage in (2, 1):
        cfg = load_config("qwen7b_rkv", [f"zero_stage={stage}", *shape])
        plan = make_plan(cfg, setup_of(cfg, m, world, liger=True, reference=cfg.loss.kl_coef > 0), H100, "H100")
        assert not plan.optimizer_offload and plan.keep_state
        layers[stage] = plan.checkpointed_layers if plan.gradient_checkpointing else 0
    assert (layers[2], layers[1]) == (zero_2, zero_1)
    cfg = load_config("qwen7b_rkv", shape)
    plan = plan_zero_stage(cfg, setup_of(cfg, m, world, liger=True, reference=cfg.loss.kl_coef > 0), H100, "H100")
    assert plan.zero_stage == 2 and plan.setup.zero_stage == 2
    assert (plan.checkpointed_layers if plan.gradient_checkpointing else 0) == zero_2
    assert plan.zero_note == f"auto: ZeRO 1 would checkpoint {zero_1 - zero_2} more layers"
    assert f"ZeRO 2 (auto: ZeRO 1 would checkpoint {zero_1 - zero_2} more layers) over " \
           f"{world} GPUs" in plan_table(plan)


def test_zero_stage_auto_takes_zero_1_where_it_costs_nothing():
    """Two H200s (torch reports 139.3 GiB free at start), qwen7b_rkv at the paper's
    per-GPU shape: under either stage the update fits without checkpointing and the
    training state stays through rollouts, so auto takes ZeRO 1 (measured: update 92.3 s,
    51.5% MFU, against 104.7 s, 46.2%, under ZeRO 2). Where only ZeRO 2 fits, ZeRO 2; a
    stage set is kept even where ZeRO 1 would cost layers."""
    m = shape_of(shape_config("qwen2.5-7b"))
    h200 = int(139.3 * GIB)
    shape = ["data.max_prompt_len=1024", "rollout_batch_size=64", "global_batch_size=128"]
    cfg = load_config("qwen7b_rkv", shape)
    plan = plan_zero_stage(cfg, setup_of(cfg, m, 2, liger=True, reference=cfg.loss.kl_coef > 0), h200, "H200")
    assert (plan.zero_stage, plan.gradient_checkpointing, plan.keep_state) == (1, False, True)
    assert plan.zero_note == "auto: it fits as ZeRO 2 would, with one gradient reduction a step"
    assert plan.record()["zero_stage"] == 1
    # measured 109.3 GiB in the update (two H200s); planned:
    assert round(plan.peaks["update"] / GIB, 1) == 109.2
    # a GPU on which ZeRO 1's optimizer step alone cannot fit: 2P + 14P/2 + 2P > 0.92 C
    tight = int(step_peak(replace(plan.setup, zero_stage=2)) / 0.92) + GIB
    plan = plan_zero_stage(cfg, setup_of(cfg, m, 2, liger=True, reference=cfg.loss.kl_coef > 0), tight, "GPU")
    # (ZeRO 1 fits there only with the optimizer on the CPU, which ZeRO 2 avoids)
    assert plan.zero_stage == 2 and not plan.cpu_adam
    assert plan.zero_note == "auto: ZeRO 1 would need the optimizer on the CPU"
    fixed = load_config("qwen7b_rkv", [*shape, "zero_stage=1"])
    plan = plan_zero_stage(fixed, setup_of(fixed, m, 4, liger=True, reference=fixed.loss.kl_coef > 0), H100, "H100")
    assert plan.zero_stage == 1 and plan.zero_note == ""


@pytest.mark.parametrize("response,tokens,layers,without", [
    # 4k: sequences of 160 + 4,096 = 4,256 tokens, micro-batches up to 8,192. Without
    # checkpointing, at a later micro-batch's first gradient-bucket flush: state 14P (40.24
    # GiB) + the previous micro-batch's gradients 2P (5.75) + activations 8192 x 36 x 91,720
    # = 25.19 GiB less the last 36 x 0.1802 = 6.49 layers' (4.54; f = 5e8 / (36 x
    # 77,070,336)) + the new gradient partition 2P (5.75) + the bucket 1e9 bytes (0.93) +
    # the head's gradient 2VH (0.58) + one layer's work 8192 x 2 x (11008 + 4096) (0.23) =
    # 74.13 GiB, over the 72.68 planned for. Each layer checkpointed keeps 8192 x 2 x 2048
    # bytes of its 8192 x 91,720: 0.67 GiB less; 2 layers: 72.79, 3 layers: 72.12.
    (4096, 8192, 3, 74.1),
    # ... at 4,096 tokens a micro-batch holds one 4,256-token sequence: 64.07 GiB (one
    # 4,247-token sequence measured 64.05 on an H100): fits, checkpointing stays off.
    (4096, 4096, 0, 64.1),
    # 8k: one 8,352-token sequence is a micro-batch of its own although max_tokens_per_gpu
    # is 8,192: 25.68 GiB of activations, 74.53 GiB in all (qwen3b_rkv at 8k with
    # checkpointing off ran out of memory there); 0.68 GiB less a checkpointed layer.
    (8192, 8192, 3, 74.5),
    # 16k: 16,544 tokens, 50.88 GiB of activations alone: 99.0 GiB without checkpointing.
    # With the first 20 layers checkpointed the start of the backward sets the peak: state
    # and earlier gradients 45.99 + 16544 x (20 x 4096 + 16 x 91,720) = 23.87 + the LM
    # head's backward 2.09 (its saved input 2TH, float32 and bf16 weight gradients 6VH, a
    # 1,024-row chunk of logits 2 x 1024 x V) = 71.95; 19 layers: 73.33.
    (16384, 8192, 20, 99.0),
])
def test_decisions_on_an_80gb_gpu(qwen3b, response, tokens, layers, without):
    cfg, s = zero2_setup(qwen3b, f"max_response_len={response}", f"max_tokens_per_gpu={tokens}")
    plan = make_plan(cfg, s, H100, "H100")
    assert plan.gradient_checkpointing is (layers > 0) and not plan.optimizer_offload
    assert plan.checkpointed_layers == layers
    # the log-prob passes (no gradients) take at least AUTO_LOGPROB_TOKENS where they fit
    assert plan.update_tokens == tokens and plan.logprob_tokens == max(tokens, 16384)
    assert plan.peaks["logprobs"] == logprob_peak(s, max(16384, s.longest))
    worst = max(tokens, s.longest)
    off = backward_peak(s, worst, 0, False)
    assert round(off / GIB, 1) == without
    assert (off > plan.usable) is (layers > 0)
    assert plan.peaks["update"] == max(backward_peak(s, worst, layers, False), step_peak(s))
    assert plan.peaks["update"] <= plan.usable
    if layers:  # the fewest that fit
        assert backward_peak(s, worst, layers - 1, False) > plan.usable
        assert plan.note == f"auto: without it the update would need ~{without:.1f} GiB"
    assert round(plan.usable / GIB, 2) == 72.68
    table = plan_table(plan)
    assert table.startswith("memory plan: H100, 79.0 GiB, planned to 72.7 (8% kept free); "
                            "3.09B parameters, ZeRO 2 over 1 GPU")
    chosen = f"on for {layers} of 36 layers" if layers else "off"
    assert f"chosen: gradient checkpointing {chosen} (auto: " in table
    if s.longest > tokens:
        assert f"(a {s.longest:,}-token sequence alone)" in table


def test_log_prob_budget_is_the_largest_that_fits(qwen3b):
    cfg, s = zero2_setup(qwen3b, "max_response_len=4096", "max_tokens_per_gpu=8192")
    # a log-prob token more: its layer's work 2 x (3 x 2048 + 3 x 11008) and its hidden
    # state before the chunked head 2 x 2048 bytes (Liger, flash attention: no mask)
    assert logprob_peak(s, 8192) - logprob_peak(s, 4096) == 4096 * 82_432
    assert _logprob_budget(cfg, s, logprob_peak(s, 8192)) == 8192
    assert _logprob_budget(cfg, s, logprob_peak(s, 8191)) == 7936  # a multiple of 256
    assert _logprob_budget(cfg, s, logprob_peak(s, 5000)) == 4864
    assert _logprob_budget(cfg, s, logprob_peak(s, s.longest)) == s.longest  # 4,256
    # where they fit, auto gives the passes (no activations kept) 16,384 tokens, and
    # logprob_max_tokens_per_gpu what it says; without a plan, max_tokens_per_gpu
    assert _logprob_budget(cfg, s, H100) == 16384 and not_planned(cfg).logprob_tokens == 8192
    cfg, s = zero2_setup(qwen3b, "max_response_len=4096", "logprob_max_tokens_per_gpu=6000")
    assert _logprob_budget(cfg, s, H100) == 6000 == not_planned(cfg).logprob_tokens


def test_checkpointing_fixed_on_takes_every_layer(qwen3b):
    """model.gradient_checkpointing=true is every layer, as a user asking for it expects:
    at 16k the backward then needs 56.98 GiB and the optimizer step (63.23) sets the peak."""
    cfg, s = zero2_setup(qwen3b, "max_response_len=16384", "model.gradient_checkpointing=true")
    plan = make_plan(cfg, s, H100, "H100")
    assert plan.checkpointed_layers == 36 and plan.peaks["update"] == step_peak(s)
    assert round(backward_peak(s, 16544, 36, False) / GIB, 2) == 56.98
    assert "chosen: gradient checkpointing on for 36 of 36 layers" in plan_table(plan)


@pytest.mark.parametrize("config,gib,keep", [
    # R-KV 512/128: at most 640 cached tokens, 41 pages of 16 = 656 tokens, x 256
    # sequences (32 prompts x 8) = 167,936 tokens. Beside the weights 2P (5.75 GiB) and the
    # training state 12P + 2P (40.24) the pool gets 0.8 x (79 - 45.99) = 26.41 GiB, 769,326
    # tokens of 36 x 2 x 2 x 128 x 2 = 36,864 bytes: the state stays.
    ("qwen3b_rkv", 79, True),
    # dense: 160 + 4,096 tokens, 268 pages = 4,272 tokens x 256 = 1,093,632: it leaves
    ("qwen3b_dense", 79, False),
    # ... on a 140 GiB GPU the pool beside it is 75.21 GiB, 2,190,729 tokens: it stays
    ("qwen3b_dense", 140, True),
])
def test_training_state_stays_where_the_rollout_fits_beside_it(qwen3b, config, gib, keep):
    cfg = load_config(config, ["data.max_prompt_len=160", "rollout_batch_size=32",
                               "global_batch_size=64"])
    s = setup_of(cfg, qwen3b, 1, liger=True, reference=cfg.loss.kl_coef > 0)
    assert (s.rollout_sequences, rollout_kv_need(s)) == (
        256, 256 * (656 if config == "qwen3b_rkv" else 4272))
    plan = make_plan(cfg, s, gib * GIB, "GPU")
    assert plan.keep_state is keep
    assert kv_tokens(s, gib * GIB, True) == {79: 769_326, 140: 2_190_729}[gib]
    kept = "training state 40.2 (kept: 256 sequences of up to"
    assert (kept in plan_table(plan)) is keep
    # a fixed pool: the state stays where weights 5.75 + state 40.24 + pool + sampling's
    # 1.16 GiB fit in the 72.68 planned for: with 10 GiB (57.15) yes, 30 GiB (77.15) no
    for pool, kept in ((10, True), (30, False)):
        fixed = setup_of(load_config(config, [f"engine.kv_memory_gb={pool}"]), qwen3b, 1, True, True)
        assert make_plan(cfg, fixed, 79 * GIB, "GPU").keep_state is kept
    # ZeRO 0 never moves its state: nothing to keep
    no_zero = setup_of(load_config(config, ["zero_stage=0"]), qwen3b, 1, liger=True, reference=True)
    assert not make_plan(cfg, no_zero, 200 * GIB, "GPU").keep_state


def test_four_gpus_shard_the_state_and_need_no_checkpointing(qwen3b):
    """8k on 4 GPUs, ZeRO 2: state 2P + 12P/4 = 5P, gradients 2P/4 each: 43.55 GiB."""
    cfg, s = zero2_setup(qwen3b, "max_response_len=8192", world=4)
    plan = make_plan(cfg, s, H100, "H100")
    assert not plan.gradient_checkpointing and round(plan.peaks["update"] / GIB, 2) == 43.55


def test_fixed_off_checkpointing_moves_the_optimizer_state_instead(qwen3b):
    """8k with model.gradient_checkpointing=false: only with AdamW moments and master
    weights (12P = 34.49 GiB) on the CPU does the backward fit (74.53 - 34.49 = 40.05)."""
    cfg, s = zero2_setup(qwen3b, "max_response_len=8192", "model.gradient_checkpointing=false")
    plan = make_plan(cfg, s, H100, "H100")
    assert (plan.gradient_checkpointing, plan.optimizer_offload) == (False, True)
    assert round(backward_peak(s, 8352, 0, True) / GIB, 2) == 40.05


@pytest.mark.parametrize("overrides,line", [
    # 16k with both fixed off: 99.0 GiB; either checkpointing or the offload (64.5) fits
    (["max_response_len=16384", "model.gradient_checkpointing=false", "optimizer_offload=false"],
     "model.gradient_checkpointing=false: the update needs ~99.0 GiB of the 72.7 GiB planned "
     "for (79.0 GiB GPU, 8% kept free) at max_tokens_per_gpu=8192 (sequences up to 16544 "
     "tokens); set it true or optimizer_offload=true"),
    # micro-batches of 327,680 tokens, even with checkpointing and the optimizer state on
    # the CPU: 92.9 GiB
    (["max_response_len=4096", "max_tokens_per_gpu=327680"],
     "max_tokens_per_gpu=327680: the update needs ~92.9 GiB of the 72.7 GiB planned for "),
    # unfused logits: 16,544 x 151,936 x 14 bytes (32.8 GiB) in the update's LM head
    (["max_response_len=16384", "model.logprob_chunk=0", "optimizer_offload=false"],
     "model.logprob_chunk=0: the update needs ~83.0 GiB of the 72.7 GiB planned for "),
    (["max_response_len=400000"], "max_response_len=400000: one sequence of 400160 tokens "
                                  "(data.max_prompt_len 160 + max_response_len) needs ~"),
])
def test_settings_that_cannot_fit_are_one_line(qwen3b, overrides, line):
    cfg, s = zero2_setup(qwen3b, *overrides)
    with pytest.raises(ConfigError) as info:
        make_plan(cfg, s, H100, "H100")
    message = str(info.value)
    assert message.startswith(line) and "\n" not in message
    if "327680" in message:  # the largest budget that fits, in steps of 256
        budget = int(message.rsplit("<=", 1)[1])
        assert budget % 256 == 0
        assert backward_peak(s, budget, 36, True) <= 0.92 * H100
        assert backward_peak(s, budget + 256, 36, True) > 0.92 * H100
    if "max_response_len<=" in message:
        longest = 160 + int(message.split("max_response_len<=")[1].split()[0])
        assert backward_peak(s, longest, 36, True) <= 0.92 * H100
    if "logprob_chunk" in message:
        assert message.endswith("set it 1024 or optimizer_offload=true")


def test_a_model_whose_optimizer_step_cannot_fit_names_the_gpus():
    """Qwen2.5-7B on one GPU: 22P = 22 x 7,614,699,008 bytes = 156.0 GiB. With the
    optimizer's step kept on the GPU (optimizer_offload=true) the plan stops and names the
    CPU's step; under auto it takes it (test_small_gpus.py)."""
    shape = shape_of(shape_config("qwen2.5-7b"))
    assert shape.params == 7_614_699_008
    cfg = load_config("qwen7b_rkv", ["data.max_prompt_len=160", "optimizer_offload=true"])
    with pytest.raises(ConfigError, match=r"^zero_stage=auto \(ZeRO 2\): the optimizer step "
                                          r"alone needs ~156\.0 GiB of the 72\.7 GiB planned "
                                          r"for on each of 1 GPU\(s\) \(weights, fp32 master "
                                          r"weights, AdamW moments, gradients\); set "
                                          r"optimizer_offload=cpu_adam \(the step on the CPU\) "
                                          r"or use more GPUs$"):
        plan_zero_stage(cfg, setup_of(cfg, shape, 1, True, cfg.loss.kl_coef > 0), H100, "H100")
    auto = load_config("qwen7b_rkv", ["data.max_prompt_len=160"])
    assert plan_zero_stage(auto, setup_of(auto, shape, 1, True, auto.loss.kl_coef > 0), H100, "H100").cpu_adam
    fixed = load_config("qwen7b_rkv", ["data.max_prompt_len=160", "zero_stage=1",
                                       "optimizer_offload=true"])
    with pytest.raises(ConfigError, match=r"^zero_stage=1: the optimizer step alone needs"):
        make_plan(fixed, setup_of(fixed, shape, 1, True, fixed.loss.kl_coef > 0), H100, "H100")


def test_planned_peaks_of_a_batch(qwen3b):
    """Two 4,247-token sequences, one optimizer step, after earlier steps: the update's
    peak 64.07 GiB (64.05 measured on an H100), log-probs with the reference visiting
    46.60 (46.48 measured when Liger's head ran them: 2bTH, ours bTH + b·chunk·V). Before any step there are no AdamW moments yet: the log-probs
    need 8P less, and the first optimizer step makes them (20P)."""
    cfg, s = zero2_setup(qwen3b, "max_response_len=4096", "max_tokens_per_gpu=4096",
                         "logprob_max_tokens_per_gpu=4096")
    plan = make_plan(cfg, s, H100, "H100")
    peaks = batch_peaks(plan, [4247, 4247], num_steps=1, steps_done=3)
    assert round(peaks["update"] / GIB, 2) == 64.07
    assert round(peaks["logprobs"] / GIB, 2) == 46.60
    first = batch_peaks(plan, [4247, 4247], num_steps=1, steps_done=0)
    assert peaks["logprobs"] - first["logprobs"] == 8 * qwen3b.params
    assert first["update"] == step_peak(s, adam=False)
    # the first rollout's update with 4 steps: steps 2-4 find the moments step 1 made (an
    # H100 at 16k measured 63.6 GiB there, against the steady step's 63.2 planned)
    four = batch_peaks(plan, [4247] * 8, num_steps=4, steps_done=0)
    assert four["update"] == max(peaks["update"], step_peak(s, adam=True))
    assert four["update"] > first["update"]
    # the log-prob passes pack the whole batch, the update each step apart: two steps of
    # 3,000 + 3,000 and 1,000 + 1,000 tokens pair as 3,000 + 1,000 for the log-probs
    mixed = batch_peaks(plan, [3000, 3000, 1000, 1000], num_steps=2, steps_done=1)
    assert plan.logprob_tokens >= 4000
    assert mixed["logprobs"] == logprob_peak(s, 4000)
    metrics = {"mem/update_peak_gib": 66.0, "memory_plan/update_gib": 60.0,
               "memory_plan/logprobs_gib": 40.0}
    metrics |= plan_errors(metrics)
    assert metrics["memory_plan/update_error"] == pytest.approx(0.1)
    assert "memory_plan/logprobs_error" not in metrics  # nothing measured (no GPU)
    assert comparison_line(metrics) == ("memory plan vs measured: update 66.0 GiB measured, "
                                        "60.0 planned (+10.0%)")


def test_without_a_gpu_nothing_is_planned():
    cfg = load_config("tiny_rkv", ["model.gradient_checkpointing=true"])
    plan = not_planned(cfg)
    assert plan.gradient_checkpointing and plan.logprob_tokens == 2048
    assert plan_table(plan) == ("memory plan: no GPU, not planned (gradient checkpointing on; "
                            "gpu_memory_gb plans for a GPU of that size)")
    assert not not_planned(load_config("tiny_rkv")).gradient_checkpointing  # auto: off


def _train(out: Path, *sets: str, config: str = "tiny_rkv") -> subprocess.CompletedProcess:
    args = [a for s in (f"output_dir={out}", "resume=never", *sets) for a in ("--set", s)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # planned as on a machine without a GPU
    return subprocess.run([sys.executable, "train.py", "--config", config, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600, check=False, env=env)


def test_train_stops_before_any_model_loads(tmp_path):
    """The 3B shape at 16k responses with both switches fixed off, planned for an 80 GB
    GPU from a machine without one: exit 2 and the plan's one line, nothing trained."""
    res = _train(tmp_path / "out", "model.path=qwen2.5-3b", "data.path=synthetic",
                 "gpu_memory_gb=79", "max_response_len=16384", "data.max_prompt_len=160",
                 "model.gradient_checkpointing=false", "optimizer_offload=false",
                 config="qwen3b_rkv")
    assert res.returncode == 2, res.stderr[-3000:]
    (line,) = res.stderr.splitlines()
    # without a GPU the training passes would run PyTorch's ops (no Liger): 130,120 bytes a
    # token and layer, 120.3 GiB in all under ZeRO 2, which zero_stage=auto falls back to
    # (ZeRO 1 needs more); even with the optimizer state on the CPU 86.7
    assert line == ("error: model.gradient_checkpointing=false: the update needs ~120.3 GiB "
                    "of the 72.7 GiB planned for (79.0 GiB GPU, 8% kept free) at "
                    "max_tokens_per_gpu=8192 (sequences up to 16544 tokens); set it true")
    assert "training passes" not in res.stdout and not (tmp_path / "out" / "metrics.jsonl").exists()


def test_tiny_run_with_a_planned_gpu(tmp_path):
    """gpu_memory_gb on a CPU machine: the table, memory_plan.json, and each rollout's
    planned peaks in metrics.jsonl; the run trains as without it."""
    out = tmp_path / "out"
    res = _train(out, "num_rollout=1", "save_interval=0", "gpu_memory_gb=1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("memory plan: gpu_memory_gb=1, 1.0 GiB, planned to 0.9 (8% "
                                 "kept free); 0.1M parameters, ZeRO 2 over 1 GPU")
    assert "chosen: gradient checkpointing off (auto: the update fits without it)" in res.stdout
    plan = json.loads((out / "memory_plan.json").read_text())
    assert plan["planned"] and plan["update_tokens"] == 2048 and plan["logprob_tokens"] == 16384
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 0 < row["memory_plan/update_gib"] < row["memory_plan/rollout_gib"] < 1


def _saved_zero_stage(out: Path) -> int:
    (states,) = out.glob("checkpoints/*/ds/state/mp_rank_00_model_states.pt")
    return torch.load(states, weights_only=False)["ds_config"]["zero_optimization"]["stage"]


def test_train_builds_deepspeed_with_the_planned_zero_stage(tmp_path):
    """zero_stage=auto: the plan's choice is the stage DeepSpeed runs (read back from the
    checkpoint); without a plan (no GPU, no gpu_memory_gb) ZeRO 2. Both save and train."""
    sets = ("num_rollout=1", "save_interval=1", "zero_stage=auto")
    res = _train(tmp_path / "planned", *sets, "gpu_memory_gb=1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("ZeRO 1 (auto: it fits as ZeRO 2 would, with one gradient reduction a step) "
            "over 1 GPU") in res.stdout
    assert json.loads((tmp_path / "planned" / "memory_plan.json").read_text())["zero_stage"] == 1
    assert _saved_zero_stage(tmp_path / "planned") == 1
    res = _train(tmp_path / "unplanned", *sets)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _saved_zero_stage(tmp_path / "unplanned") == 2
    assert not_planned(load_config("tiny_rkv", ["zero_stage=auto"])).zero_stage == 2


def test_memory_in_use_elsewhere_is_named(monkeypatch):
    """A GPU another process still holds memory on (a killed run still exiting, a
    neighbour's job) is planned for what is free, and the plan's first line says so: the
    rollout's KV pool is sized again from what is free when it starts."""
    cfg = load_config("tiny_rkv")
    cuda = torch.cuda
    free = {"now": 97 * GIB}
    monkeypatch.setattr(cuda, "mem_get_info", lambda device: (free["now"], 140 * GIB))
    monkeypatch.setattr(cuda, "memory_reserved", lambda device: GIB)
    monkeypatch.setattr(cuda, "get_device_name", lambda device: "NVIDIA H200")
    capacity, name = gpu_capacity(cfg, torch.device("cuda", 0))
    assert capacity == 98 * GIB
    assert name == "NVIDIA H200 (42.0 of its 140.0 GiB in use elsewhere)"
    free["now"] = 138 * GIB + GIB // 2  # the CUDA context alone: nothing to name
    assert gpu_capacity(cfg, torch.device("cuda", 0)) == (139 * GIB + GIB // 2, "NVIDIA H200")
    capped = load_config("tiny_rkv", ["gpu_memory_gb=80"])
    assert gpu_capacity(capped, torch.device("cuda", 0))[0] == 80 * GIB
