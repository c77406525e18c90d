"""The training-side peer: what a plain Hugging Face loop gets for the same log-prob and
update work as scripts/bench_train_phases.py, on the same GPU, in the same command.

    python -m scripts.bench_hf_peer --stacks hf,liger,liger_fa4 --samples 32 \
        --prompt-len 160 --response-len 3840 --seqs-per-mb 4 --repeats 3

The model is the named shape's transformers model with random bf16 weights (the same
config minisparse builds for `model.path=qwen2.5-3b`), nothing of minisparse's training
passes in it. Each micro-batch is --seqs-per-mb sequences of equal length (no padding, no
packing), gradient checkpointing on every layer, as TRL-style trainers run it:

  logprobs  no-grad forward and the response tokens' log-probs
  update    forward + backward of a policy-gradient loss (no optimizer step: compare it
            with the bench's update_fwd_bwd figures)

Stacks: hf (transformers' SDPA attention, the LM head's logits in float32 and a
log-softmax one sequence at a time), liger (Liger Kernel's RMSNorm, SwiGLU and RoPE, and
its fused linear cross-entropy as the log-prob), liger_fa4 (the same with flash-attn-4 as
the attention). MFU counts FLOPs as the trainer does (minisparse/models/flops.py), so the
figures stand beside the bench's perf/*_mfu. On a CPU (`--model tiny`, the hf stack)
it only checks that the loop runs.
"""

from __future__ import annotations

import argparse
import json

import torch

from minisparse.models.flops import flop_shape, forward_flops, peak_flops
from minisparse.models.loading import SHAPES, shape_config
from minisparse.models.tiny import TINY_MODEL
from minisparse.trainer.measure import timed

STACKS = ("hf", "liger", "liger_fa4")


def build_model(name: str, attention: str, device: torch.device) -> torch.nn.Module:
    """The shape's transformers model, random weights (seeded), bf16 on a GPU."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = (shape_config(name) if name in SHAPES
              else Qwen2Config(vocab_size=512, **TINY_MODEL))
    config._attn_implementation = attention
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    return model


def flash_attn_4(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **_):
    """transformers' attention interface over flash-attn-4 (causal, unpadded batches):
    q, k, v arrive [B, H, L, D] and leave [B, L, H, D]."""
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(*(t.transpose(1, 2) for t in (query, key, value)),
                          softmax_scale=scaling, causal=True)
    return (out[0] if isinstance(out, tuple) else out), None


def plain_logprobs(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Response log-probs [B, R] the way TRL computes them: float32 logits per sequence."""
    hidden = model.model(input_ids=ids).last_hidden_state[:, prompt_len - 1:-1]
    rows = []
    for b in range(ids.shape[0]):
        logits = model.lm_head(hidden[b]).float()
        target = ids[b, prompt_len:, None]
        rows.append(logits.gather(-1, target).squeeze(-1) - logits.logsumexp(-1))
    return torch.stack(rows)


def liger_logprobs(loss, model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Response log-probs [B, R] through Liger's fused linear cross-entropy (no logits)."""
    hidden = model.model(input_ids=ids).last_hidden_state[:, prompt_len - 1:-1]
    flat = hidden.reshape(-1, hidden.shape[-1])
    return -loss(model.lm_head.weight, flat, ids[:, prompt_len:].reshape(-1)).view(len(ids), -1)


def prepare(stack: str, model_name: str, device: torch.device):
    """(model, log-prob function) of a stack."""
    attention = "sdpa"
    if stack == "liger_fa4":
        from transformers import AttentionInterface

        AttentionInterface.register("fa4", flash_attn_4)  # a name with "flash" in it sends transformers to the kernel hub
        attention = "fa4"
    model = build_model(model_name, attention, device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if stack == "hf":
        return model, lambda ids, p: plain_logprobs(model, ids, p)
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2
    from liger_kernel.transformers.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyLoss)

    apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=False, model=model)
    loss = LigerFusedLinearCrossEntropyLoss(reduction="none")
    return model, lambda ids, p: liger_logprobs(loss, model, ids, p)


def run_stack(stack: str, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """One stack's repeats: a warm-up pass of each phase, then --repeats timed ones."""
    model, logprobs = prepare(stack, args.model, device)
    length, n, per = args.prompt_len + args.response_len, args.samples, args.seqs_per_mb
    g = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (n, length), device=device, generator=g)
    advantages = torch.randn(n, device=device, generator=g)
    batches = [slice(i, i + per) for i in range(0, n, per)]
    flops = forward_flops(flop_shape(model), [length] * n, args.response_len * n)
    peak = peak_flops(0.0, device)

    def logprob_pass() -> None:
        model.eval()
        with torch.no_grad():
            for b in batches:
                logprobs(ids[b], args.prompt_len)

    def update_pass() -> None:
        model.train()
        for b in batches:
            loss = -(advantages[b, None] * logprobs(ids[b], args.prompt_len)).mean()
            (loss * (b.stop - b.start) / n).backward()
        model.zero_grad(set_to_none=True)

    logprob_pass(), update_pass()  # kernels compile, the allocator settles
    rows = []
    for repeat in range(args.repeats):
        t_lp, t_up = timed(logprob_pass, device), timed(update_pass, device)
        row = {"stack": stack, "repeat": repeat, "tokens": n * length, "logprobs_s": t_lp,
               "update_fwd_bwd_s": t_up}
        if peak:
            row |= {"logprobs_mfu": flops / t_lp / peak, "update_fwd_bwd_mfu": 3 * flops / t_up / peak}
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-3b", help="a shape name, or tiny (CPU check)")
    p.add_argument("--stacks", default="liger_fa4", help=f"comma-separated: {', '.join(STACKS)}")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=160)
    p.add_argument("--response-len", type=int, default=3840)
    p.add_argument("--seqs-per-mb", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write every row here")
    args = p.parse_args()
    stacks = args.stacks.split(",")
    if unknown := [s for s in stacks if s not in STACKS]:
        p.error(f"unknown stack(s) {', '.join(unknown)}; choose from {', '.join(STACKS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for stack in stacks:
        rows += run_stack(stack, args, device)
        if device.type == "cuda":  # the stack's model is gone: its memory goes back
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
