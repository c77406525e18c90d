"""Times train.py's log-prob and update phases for several variants, in one process.

    python scripts/bench_train_phases.py --config qwen3b_rkv --set model.path=qwen2.5-3b \
        --samples 128 --response-len 1024 --repeats 2

One DeepSpeed engine (the config's ZeRO stage, AdamW, bf16) and one reference model, a
synthetic rollout batch shaped like a random-weight rollout (every response runs to
--response-len), then train.py's own `logprob_phase` and `update_phase` (with `phase`
timing and memory, and `perf_metrics`) for each variant, each run --repeats times on
the same batch. Variants set model.attention, model.logprob_chunk, max_tokens_per_gpu
and gradient checkpointing; `after` is train.py's defaults (attention auto: flash-attn-4
where it runs, else torch's varlen kernel; each row names the one that ran), and
`torch_varlen` / `flash_attn` the same with that attention asked for by name
(`--variants torch_varlen,flash_attn` compares the two; flash_attn stops with the reason
where it cannot run). Before any update, the old log-probs of the first variant and
each other one are compared on the same weights (relative L2 over response tokens).
The rollout, reward and swap phases are left out: no engine is built.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import train  # noqa: E402
from minisparse.config.cli import add_config_args, config_from_args  # noqa: E402
from minisparse.grpo import distributed as dist  # noqa: E402
from minisparse.grpo.attention import use_attention  # noqa: E402
from minisparse.grpo.flops import flop_shape, peak_flops  # noqa: E402
from minisparse.grpo.logprobs import batch_logprobs  # noqa: E402
from minisparse.grpo.memory import phase  # noqa: E402
from minisparse.grpo.memory_plan import not_planned  # noqa: E402
from minisparse.grpo.optim import TrainingStateOffload, build_train_engine  # noqa: E402
from minisparse.grpo.rollout import RolloutBatch  # noqa: E402
from minisparse.models.liger import use_liger_kernel  # noqa: E402
from minisparse.models.loading import load_policy  # noqa: E402

# name: (attention, logprob_chunk, max_tokens_per_gpu, gradient_checkpointing)
VARIANTS = {
    "before": ("sdpa", 0, 4096, True),
    "varlen": ("varlen", 0, 4096, True),
    "after": ("auto", 1024, 16384, True),
    "after_nockpt": ("auto", 1024, 8192, False),
    "torch_varlen": ("varlen", 1024, 16384, True),
    "flash_attn": ("flash_attn", 1024, 16384, True),
}
DEFAULT_VARIANTS = "before,varlen,after,after_nockpt"  # those that run on any GPU


def synthetic_batch(n: int, prompt_len: int, response_len: int, vocab: int, seed: int) -> RolloutBatch:
    """Random prompts of prompt_len ± 25% tokens and full-length responses."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(prompt_len * 3 // 4, prompt_len * 5 // 4 + 1, (n,), generator=g)
    prompts = [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in lens]
    responses = [torch.randint(0, vocab, (response_len,), generator=g).tolist() for _ in range(n)]
    return RolloutBatch(
        prompts=prompts,
        responses=responses,
        labels=[""] * n,
        finish_reasons=["length"] * n,
        rollout_logp=torch.zeros(n, response_len),
        response_mask=torch.ones(n, response_len, dtype=torch.bool),
        num_compressions=[0] * n,
        evicted_tokens=[0] * n,
        peak_cache_tokens=[0] * n,
        rewards=torch.zeros(n),
        advantages=torch.randn(n, generator=g),
    )


def apply_variant(run: train.Run, name: str) -> str:
    """Set the variant up; returns the attention it runs (use_attention's words)."""
    attention, chunk, max_tokens, ckpt = VARIANTS[name]
    cfg = run.cfg
    cfg.model = dataclasses.replace(cfg.model, attention=attention, logprob_chunk=chunk,
                                    gradient_checkpointing=str(ckpt).lower())
    cfg.max_tokens_per_gpu = max_tokens
    run.plan = not_planned(cfg)  # the variant's settings as given
    module = run.train_engine.module
    words = use_attention(module, attention)
    if run.ref_model is not None:  # kept on the CPU: it takes the policy's choice as is
        run.ref_model.set_attn_implementation(module.config._attn_implementation)
    if ckpt:
        module.gradient_checkpointing_enable()
    else:
        module.gradient_checkpointing_disable()
    return words


def compare_logprobs(run: train.Run, batch: RolloutBatch, names: list[str], n: int) -> dict:
    """Relative L2 difference of each variant's old log-probs to the first's, same weights."""
    module, cfg, out = run.train_engine.module, run.cfg, {}
    module.eval()
    sub = (batch.prompts[:n], batch.responses[:n], batch.width)
    ref = None
    for name in names:
        apply_variant(run, name)
        logp = batch_logprobs(module, *sub, cfg.max_tokens_per_gpu, cfg.temperature,
                              cfg.model.logprob_chunk)
        if ref is None:
            ref = logp
        out[name] = ((logp - ref).norm() / ref.norm()).item()
    return out


def run_variant(run: train.Run, batch: RolloutBatch, name: str) -> dict:
    attention = apply_variant(run, name)
    metrics: dict[str, float] = {}
    with phase("logprobs", metrics, run.device):
        train.logprob_phase(run, batch, metrics)
    with phase("update", metrics, run.device):
        train.update_phase(run, batch, metrics)
    metrics.update(train.perf_metrics(run, batch, metrics))
    return {"attention": attention, **metrics}


def build(cfg) -> train.Run:
    device = dist.init_distributed()
    policy, tokenizer = load_policy(cfg.model.path, cfg.model.dtype, device)
    print("training passes:", use_liger_kernel(policy, cfg.model.liger_kernel,
                                               device.type == "cuda"), flush=True)
    ref = None
    if cfg.loss.kl_coef > 0:
        ref = copy.deepcopy(policy).to("cpu").eval().requires_grad_(False)
    engine = build_train_engine(policy, cfg, cfg.num_rollout * cfg.num_steps_per_rollout, device)
    return train.Run(
        cfg=cfg, device=device, train_engine=engine, offload=TrainingStateOffload(engine),
        ref_model=ref, llm=None, plan=not_planned(cfg), tokenizer=tokenizer, rows=[],
        sampler=None, logger=None,
        flops=flop_shape(policy), peak=peak_flops(cfg.log.peak_tflops, device),
    )


def main() -> None:
    parser = add_config_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=160)
    parser.add_argument("--response-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--compare-samples", type=int, default=16)
    parser.add_argument("--json", default=None, help="write all metrics here")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="then profile one log-prob and one update phase of the last "
                             "variant and print the ROWS kernels that took most GPU time")
    args = parser.parse_args()
    cfg = config_from_args(args)
    names = args.variants.split(",")
    run = build(cfg)
    batch = synthetic_batch(args.samples, args.prompt_len, args.response_len,
                            run.train_engine.module.config.vocab_size, cfg.seed)
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompts, batch.responses))
    print(f"device {torch.cuda.get_device_name() if run.device.type == 'cuda' else 'cpu'}, "
          f"{len(batch)} samples, {tokens} tokens, peak {run.peak}", flush=True)
    results = {"compare": compare_logprobs(run, batch, names, args.compare_samples), "runs": []}
    print("old log-probs vs", names[0], results["compare"], flush=True)
    # warm-up, and the sampler's log-probs: dense ones, so the corrections keep every token
    batch.rollout_logp = batch_logprobs(run.train_engine.module, batch.prompts, batch.responses,
                                        batch.width, cfg.max_tokens_per_gpu, cfg.temperature,
                                        cfg.model.logprob_chunk)
    for name in names:
        for rep in range(args.repeats):
            try:
                m = run_variant(run, batch, name)
            except Exception:  # one variant's failure (e.g. out of memory) leaves the others
                traceback.print_exc()
                m = {"error": 1.0}
                torch.cuda.empty_cache() if run.device.type == "cuda" else None
            results["runs"].append({"variant": name, "repeat": rep, **m})
            print(json.dumps({"variant": name, "repeat": rep, **m}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print_table(results["runs"])
    if args.profile:
        profile_phases(run, batch, names[-1], args.profile)


def profile_phases(run: train.Run, batch: RolloutBatch, name: str, rows: int) -> None:
    """Where each phase's GPU time goes, kernel by kernel (torch profiler), and how much of
    the phase's wall time the GPU sat idle."""
    from torch.profiler import ProfilerActivity, profile

    apply_variant(run, name)
    for label, fn in (("logprobs", train.logprob_phase), ("update", train.update_phase)):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn(run, batch, {})
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        busy = sum(e.time_range.elapsed_us() for e in kernels)
        wall = max(e.time_range.end for e in prof.events()) - min(
            e.time_range.start for e in prof.events())
        print(f"--- {name} {label}: kernels {busy / 1e6:.2f} s of {wall / 1e6:.2f} s wall")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60))


def print_table(rows: list[dict]) -> None:
    cols = ("time/logprobs_s", "perf/logprobs_tflops", "perf/logprobs_mfu", "mem/logprobs_peak_gib",
            "time/update_s", "perf/update_tflops", "perf/update_mfu", "mem/update_peak_gib",
            "train/micro_batches")
    print(f"{'variant':14s} {'rep':>3s} " + " ".join(f"{c.split('/')[1][:16]:>16s}" for c in cols))
    for r in rows:
        vals = " ".join(f"{r.get(c, float('nan')):16.3f}" for c in cols)
        print(f"{r['variant']:14s} {r['repeat']:3d} {vals}")


if __name__ == "__main__":
    main()
