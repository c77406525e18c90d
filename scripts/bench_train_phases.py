"""Times train.py's log-prob and update phases for several variants, in one process a GPU
(torchrun --nproc_per_node N for ZeRO across N ranks; rank 0 reports).

    python -m scripts.bench_train_phases --config qwen3b_rkv --set model.path=qwen2.5-3b \
        --samples 128 --response-len 1024 --repeats 2

One DeepSpeed engine (the config's ZeRO stage, AdamW, bf16) and one reference model, a
synthetic rollout batch shaped like a random-weight rollout (every response runs to
--response-len), then train.py's own `logprob_phase` and `update_phase` (with `phase`
timing and memory, and `perf_metrics`) for each variant, each run --repeats times on the
same batch. A variant sets the training attention (model.attention), the update's and
the log-prob passes' micro-batch budgets (max_tokens_per_gpu,
logprob_max_tokens_per_gpu; the plan may give the passes less), gradient checkpointing
("plan": what the memory plan chooses on this GPU for that budget, "all" or "none") and
the LM head's softmax work: "kernels" (train.py's Triton kernels) or "torch" (the
PyTorch ops, the CPU path). `default` is train.py as it runs (attention auto:
flash-attn-4 where it runs, else torch's varlen kernel; each row names the one that
ran). Before any update, the old log-probs of the first variant and each other one are
compared on the same weights (relative L2 over response tokens).
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
from dataclasses import dataclass

import torch

import train
from minisparse.config.cli import add_config_args, config_from_args
from minisparse.grpo.batch import RolloutBatch
from minisparse.models import fused_logprobs
from minisparse.models.attention import use_attention
from minisparse.models.checkpointing import checkpoint_layers, checkpointed_count
from minisparse.models.flops import flop_shape, peak_flops
from minisparse.models.liger import use_liger_kernel
from minisparse.models.loading import load_policy
from minisparse.utils import distributed as dist
from minisparse.trainer.logprobs import batch_logprobs
from minisparse.trainer.measure import phase
from minisparse.trainer.memory.phases import Swaps
from minisparse.trainer.memory.plan import plan_memory
from minisparse.trainer.policy import Reference
from minisparse.trainer.train_engine import build_train_engine

@dataclass(frozen=True)
class Variant:
    attention: str = "auto"
    max_tokens: int = 8192  # the update's micro-batch budget (max_tokens_per_gpu)
    logprob_tokens: int = 0  # the log-prob passes' (logprob_max_tokens_per_gpu; 0: auto)
    checkpointing: str = "plan"  # "plan" (the memory plan's layers), "all" or "none"
    head: str = "kernels"  # "kernels" or "torch": the fused LM head's softmax work


VARIANTS = {
    "default": Variant(),
    "default_10k": Variant(max_tokens=10240),  # pairs of the paper's 4k-response sequences
    "default_16k": Variant(max_tokens=16384),
    "logprobs_8k": Variant(logprob_tokens=8192),  # log-prob micro-batches as the update's
    "logprobs_32k": Variant(logprob_tokens=32768),
    # the trainer before the head kernels and the planned checkpointing
    "before": Variant(max_tokens=16384, logprob_tokens=16384, checkpointing="all", head="torch"),
    "kernels_all": Variant(max_tokens=16384, checkpointing="all"),
    "no_ckpt": Variant(checkpointing="none"),
    "torch_varlen": Variant(attention="varlen"),
    "flash_attn": Variant(attention="flash_attn"),
}
DEFAULT_VARIANTS = "before,default"
KERNELS = fused_logprobs.KERNELS  # train.py's head kernels; a "torch" variant sets None


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
        compressed_tokens=[0] * n,
        rewards=torch.zeros(n),
        advantages=torch.randn(n, generator=g),
    )


def apply_variant(run: train.Run, name: str) -> str:
    """Set the variant up; returns the attention it runs (use_attention's words) and the
    layers checkpointed."""
    v = VARIANTS[name]
    cfg = run.cfg
    module = run.train_engine.module
    cfg.max_tokens_per_gpu, cfg.logprob_max_tokens_per_gpu = v.max_tokens, v.logprob_tokens
    cfg.model = dataclasses.replace(cfg.model, attention=v.attention, gradient_checkpointing="auto")
    run.plan = plan_memory(cfg, run.device, dist.world_size(), run.reference is not None)
    layers = {"plan": run.plan.checkpointed_layers if run.plan.gradient_checkpointing else 0,
              "all": None, "none": 0}[v.checkpointing]
    run.plan.update_tokens = v.max_tokens  # (the plan's log-prob budget: train.py's)
    words = use_attention(module, v.attention)
    if run.reference is not None:  # kept on the CPU: it takes the policy's choice as is
        run.reference.module.set_attn_implementation(module.config._attn_implementation)
    checkpoint_layers(module, layers)
    fused_logprobs.KERNELS = KERNELS if v.head == "kernels" else None
    return f"{words}; {checkpointed_count(module)} layers checkpointed"


def compare_logprobs(run: train.Run, batch: RolloutBatch, names: list[str], n: int) -> dict:
    """Relative L2 difference of each variant's old log-probs to the first's, same weights."""
    module, cfg, out = run.train_engine.module, run.cfg, {}
    module.eval()
    sub = (batch.prompts[:n], batch.responses[:n], batch.width)
    ref = None
    for name in names:
        apply_variant(run, name)
        logp = batch_logprobs(module, *sub, run.plan.logprob_tokens, cfg.temperature,
                              cfg.model.logprob_chunk)
        if ref is None:
            ref = logp
        out[name] = ((logp - ref).norm() / ref.norm()).item()
    return out


def set_sampler_logprobs(run: train.Run, batch: RolloutBatch) -> None:
    """The sampler's log-probs: dense ones, so the corrections keep every token."""
    cfg = run.cfg
    batch.rollout_logp = batch_logprobs(run.train_engine.module, batch.prompts, batch.responses,
                                        batch.width, run.plan.logprob_tokens, cfg.temperature,
                                        cfg.model.logprob_chunk)


def run_variant(run: train.Run, batch: RolloutBatch, name: str) -> dict:
    attention = apply_variant(run, name)
    metrics: dict[str, float] = {}
    with phase("logprobs", metrics, run.device):
        batch, made = train.logprob_phase(run, batch)
        metrics |= made
    with phase("update", metrics, run.device):
        metrics |= train.update_phase(run, batch)
    metrics |= train.perf_metrics(run, batch, metrics)
    return {"attention": attention, **metrics}


def build(cfg) -> train.Run:
    device = dist.init_distributed()
    if dist.rank():  # every rank runs the phases (their collectives need it); one reports
        sys.stdout = open(os.devnull, "w")
    policy, tokenizer = load_policy(cfg.model.path, cfg.model.dtype, device)
    print("training passes:", use_liger_kernel(policy, cfg.model.liger_kernel,
                                               device.type == "cuda"), flush=True)
    ref = None
    if cfg.loss.kl_coef > 0:
        ref = Reference(copy.deepcopy(policy).to("cpu").eval().requires_grad_(False), device)
    # the plan's ZeRO stage and optimizer offload, as train.py builds them (a 24 GB cap
    # cannot hold AdamW's state beside the weights); each variant plans its budgets again
    plan = plan_memory(cfg, device, dist.world_size(), ref is not None)
    engine = build_train_engine(policy, cfg, cfg.num_rollout * cfg.num_steps_per_rollout,
                                device, plan.zero_stage, plan.cpu_adam)
    return train.Run(
        cfg=cfg, device=device, train_engine=engine, swaps=Swaps(engine, device, plan.keep_state),
        reference=ref, llm=None, plan=plan, tokenizer=tokenizer, rows=[],
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
    parser.add_argument("--profile-new-lengths", action="store_true",
                        help="profile a batch of lengths not run before (seed + 1), as each "
                             "rollout brings; kernels compiled per shape then show")
    args = parser.parse_args()
    os.environ.setdefault(*train.ALLOCATOR)
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
    set_sampler_logprobs(run, batch)  # also the warm-up
    for name in names:
        for rep in range(args.repeats):
            try:
                m = run_variant(run, batch, name)
            except Exception:  # one variant's failure (e.g. out of memory) leaves the others
                traceback.print_exc()
                m = {"error": 1.0}
                torch.cuda.empty_cache() if run.device.type == "cuda" else None
            results["runs"].append({"variant": name, "repeat": rep, **m})
            print(name, rep, m.get("attention", ""), {k: round(v, 3) for k, v in m.items()
                  if k.startswith(("time/", "perf/", "mem/update", "mem/logprobs"))}, flush=True)
    if args.json and not dist.rank():
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print_table(results["runs"])
    if args.profile:
        if args.profile_new_lengths:
            batch = synthetic_batch(args.samples, args.prompt_len, args.response_len,
                                    run.train_engine.module.config.vocab_size, cfg.seed + 1)
            set_sampler_logprobs(run, batch)
        profile_phases(run, batch, names[-1], args.profile)


def profile_phases(run: train.Run, batch: RolloutBatch, name: str, rows: int) -> None:
    """Where each phase's GPU time goes, kernel by kernel (torch profiler), how much of the
    phase's wall time the GPU sat idle, and the ops that held the host meanwhile (on a CPU
    only the last)."""
    from torch.profiler import ProfilerActivity, profile

    apply_variant(run, name)
    cuda = run.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for label in ("logprobs", "update"):
        sync()
        with profile(activities=activities) as prof:
            if label == "logprobs":  # the update reads what the log-prob phase adds
                batch, _ = train.logprob_phase(run, batch)
            else:
                train.update_phase(run, batch)
            sync()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        busy = sum(e.time_range.elapsed_us() for e in kernels)
        wall = max(e.time_range.end for e in prof.events()) - min(
            e.time_range.start for e in prof.events())
        print(f"--- {name} {label}: kernels {busy / 1e6:.2f} s of {wall / 1e6:.2f} s wall")
        averages = prof.key_averages()
        if cuda:
            print(averages.table(sort_by="self_device_time_total", row_limit=rows,
                                 max_name_column_width=60))
        print(f"--- {name} {label}: where the host's time goes")
        print(averages.table(sort_by="self_cpu_time_total", row_limit=rows,
                             max_name_column_width=60))


def print_table(rows: list[dict]) -> None:
    cols = ("time/logprobs_s", "perf/logprobs_mfu", "mem/logprobs_peak_gib", "time/update_s",
            "perf/update_mfu", "perf/update_fwd_bwd_mfu", "time/optimizer_step_s",
            "mem/update_peak_gib", "train/micro_batches")
    print(f"{'variant':13s} {'rep':>3s} " + " ".join(f"{c.split('/')[1][:11]:>11s}" for c in cols))
    for r in rows:
        vals = " ".join(f"{r.get(c, float('nan')):11.3f}" for c in cols)
        print(f"{r['variant']:13s} {r['repeat']:3d} {vals}")


if __name__ == "__main__":
    main()
