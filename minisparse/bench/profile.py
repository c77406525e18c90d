"""Where a decode step goes: one decode step of the rollout engine, kernel by kernel, beside
the memory bound of that step; and one compaction event.

    python -m minisparse.bench.profile --model qwen2.5-1.5b --batch 16,64,256 --cache-len 768
    python -m minisparse.bench.profile --model qwen2.5-1.5b --batch 16,64,256 \
        --compress rkv --budget 192 --divide-length 32

Each batch size gets B sequences whose caches hold --cache-len entries (random K/V on
pages spread over the pool; with compression, at most the compression bound), then:
  - step: the decode step as rollouts run it (the CUDA graph the engine captures, or the
    eager step with --no-cuda-graphs), median of --steps timed with CUDA events;
  - kernels: the same step run eagerly under torch.profiler, each kernel's device time
    per step and its share (eager launches add gaps between kernels, not kernel time),
    and each part's time inside the CUDA graph's replay where the profiler sees it;
  - bound: the weights plus the B caches read once at the copy bandwidth measured here;
  - with --compress, one compaction event of all B sequences at the length where it
    falls due (budget + divide_length), timed and split by kernel the same way; with
    --compaction-scoring both, once with the fused scoring kernel the engine runs for
    SnapKV and R-KV on CUDA and once with the rule's own score_batch.
Why not the bench: it times whole rollouts; this says which kernel to fix.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable

import torch

from minisparse.bench.bound import copy_bandwidth, median_seconds, weight_bytes_per_step
from minisparse.bench.run import CONFIG_KEYS, bench_config
from minisparse.compression import max_cache_tokens
from minisparse.config.cli import HelpFormatter, add_config_flags
from minisparse.engine import LLMEngine, SamplingParams
from minisparse.engine.compaction import compact, fused_scorer
from minisparse.engine.step import decode_forward, sample_hidden
from minisparse.models.loading import kv_bytes_per_token

# Kernel-name fragments -> the part of the step they belong to (first match wins).
KINDS = (("_scores_kernel", "fused scores"), ("gemm", "GEMM"), ("gemv", "GEMM"),
         ("cutlass", "GEMM"), ("sm90_xmma", "GEMM"),
         ("nvjet", "GEMM"), ("_split_kernel", "attention"), ("_merge_splits", "attention"),
         ("_rope_kernel", "RoPE"), ("_add_rms", "RMSNorm"), ("silu", "SiLU*up"),
         ("_partial_kernel", "sampler"), ("_merge_kernel", "sampler"),
         ("_norms_sums", "redundancy"), ("_last_above", "redundancy"),
         ("_gather_keys", "key gather"), ("_compact_kernel", "packing"),
         ("topk", "top-k and sort"), ("sort", "top-k and sort"),
         ("index", "gather/scatter"), ("gather", "gather/scatter"), ("scatter", "gather/scatter"),
         ("softmax", "softmax/pooling"), ("pool", "softmax/pooling"),
         ("elementwise", "elementwise"), ("reduce", "reduction"), ("copy", "copy"))


def kind_of(kernel: str) -> str:
    low = kernel.lower()
    return next((kind for part, kind in KINDS if part in low), "other")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minisparse.bench.profile",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--batch", default="16,64,256", help="comma list of batch sizes")
    p.add_argument("--cache-len", type=int, default=768,
                   help="entries in each cache (capped at the compression bound)")
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per batch size")
    p.add_argument("--top", type=int, default=12, help="kernels listed per table")
    p.add_argument("--json", default=None, help="write the tables here")
    p.add_argument("--compaction-scoring", choices=("fused", "rule", "both"), default="fused",
                   help="score the compaction event with the fused kernel (SnapKV, R-KV: "
                        "what the engine runs), the rule's score_batch, or each in turn")
    add_config_flags(p.add_argument_group("model, compression and engine settings"),
                     CONFIG_KEYS)
    return p


def batch_sizes(args: argparse.Namespace) -> list[int]:
    """--batch as integers; the engine's sequence rows (--max-num-seqs) sized to the
    largest, since the page table has that many rows and a batch past it would index
    beyond them. A --max-num-seqs given below it is refused, naming both."""
    try:
        batches = [int(x) for x in args.batch.split(",")]
    except ValueError:
        raise SystemExit(f"error: --batch {args.batch!r}: comma-separated integers expected")
    if min(batches) < 1:
        raise SystemExit(f"error: --batch {args.batch!r}: batch sizes must be at least 1")
    largest, rows = max(batches), getattr(args, "engine.max_num_seqs")
    if rows is None:
        setattr(args, "engine.max_num_seqs", largest)
    elif int(rows) < largest:
        raise SystemExit(f"error: --batch {largest} needs --max-num-seqs of at least "
                         f"{largest} (given {rows}); leave it out to size it to the batch")
    return batches


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median CUDA-event time of fn() in ms, after 3 untimed calls."""
    return median_seconds(fn, repeats) * 1e3


def kernel_table(fn: Callable[[], object], calls: int) -> list[dict]:
    """Device time per call of each kernel fn() launches, largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name \
                and "Memset" not in e.name:
            us[e.name] += e.device_time_total
            count[e.name] += 1
    total = sum(us.values()) or 1.0
    rows = [dict(kernel=k, kind=kind_of(k), us=v / calls, launches=count[k] / calls,
                 share=v / total) for k, v in us.items()]
    return sorted(rows, key=lambda r: -r["us"])


def by_kind(rows: list[dict]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for r in rows:
        out[r["kind"]] += r["us"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def fill_caches(engine: LLMEngine, batch: int, length: int) -> torch.Tensor:
    """Rows 0..batch-1 of the page table get `length` entries each on pages taken every
    other page (not contiguous), holding random K/V; returns the rows."""
    pool = engine.pool
    per_seq = -(-length // pool.page_size)
    if 2 * batch * per_seq > pool.num_pages:
        raise SystemExit(f"error: {batch} caches of {length} entries need "
                         f"{2 * batch * per_seq} pages spread out; the pool has {pool.num_pages}")
    pages = torch.arange(batch * per_seq) * 2
    pool.set_rows(list(range(batch)), pages.view(batch, per_seq).tolist())
    used = 2 * batch * per_seq * pool.page_size
    for cache in (pool.k, pool.v):
        cache[:, :used].normal_(0, 1)
    return torch.arange(batch, device=pool.device)


def profile_batch(engine: LLMEngine, batch: int, length: int, args, sp: SamplingParams,
                  bandwidth: float, weight_bytes: int, kv_token: int) -> dict:
    dev = engine.pool.device
    rows = fill_caches(engine, batch, length)
    vocab = engine.lm.model.config.vocab_size
    ids = torch.randint(10, vocab - 512, (batch,), device=dev)
    pos = torch.full((batch,), length - 1, device=dev)
    seeds, steps = torch.arange(batch, device=dev), torch.zeros(batch, dtype=torch.long, device=dev)
    step_inputs = (ids, pos, rows, pos.clone(), seeds, steps)
    runner = engine.runner

    def eager():
        hidden = decode_forward(engine.lm, engine.pool, *step_inputs[:4], length)
        return sample_hidden(engine.lm, hidden, seeds, steps, sp)

    graphs = runner.graphs is not None and runner.graphs.fits(batch, length)
    step = (lambda: runner.graphs.run(*step_inputs, length, sp)) if graphs else eager
    with torch.inference_mode():
        step_ms = median_ms(step, args.steps)
        kernels = kernel_table(eager, 10)
        in_graph = by_kind(kernel_table(step, 10)) if graphs else {}
    bound_ms = (weight_bytes + batch * length * kv_token) / bandwidth * 1e3
    return dict(batch=batch, cache_len=length, cuda_graph=graphs, step_ms=step_ms,
                tokens_per_s=batch / step_ms * 1e3, bound_ms=bound_ms,
                bound_fraction=bound_ms / step_ms,
                kernel_us=sum(r["us"] for r in kernels), kinds=by_kind(kernels),
                graph_kinds=in_graph, kernels=kernels)


def profile_compaction(engine: LLMEngine, batch: int, fused: bool) -> dict:
    """One compaction event of `batch` sequences, each at budget + divide_length entries;
    fused False: scored by the rule's score_batch (see compaction.compact); True: as the
    engine scores it (the rule's way where the fused kernel does not serve that size)."""
    cfg = engine.compress
    length = cfg.budget + cfg.divide_length
    fused = fused and fused_scorer(engine.pool, engine.rule, batch, length) is not None
    fill_caches(engine, batch, length)
    rows, lens = list(range(batch)), [length] * batch

    def event():
        compact(engine.pool, engine.rule, rows, lens, lens, fused=fused)

    with torch.inference_mode():
        ms = median_ms(event, 10)
        kernels = kernel_table(event, 5)
    return dict(batch=batch, cache_len=length, fused=fused, ms=ms, kinds=by_kind(kernels),
                kernels=kernels)


def compaction_modes(engine: LLMEngine, scoring: str) -> list[bool]:
    """The compaction events to profile (fused or not): none for dense, and only the
    rule's path where no fused kernel serves the rule."""
    if engine.rule is None:
        return []
    if fused_scorer(engine.pool, engine.rule, 1, 1) is None:
        return [False]
    return {"fused": [True], "rule": [False], "both": [True, False]}[scoring]


def print_step(r: dict, top: int) -> None:
    print(f"\n## batch {r['batch']}, {r['cache_len']} cached entries each: step "
          f"{r['step_ms']:.3f} ms ({'CUDA graph' if r['cuda_graph'] else 'eager'}), "
          f"{r['tokens_per_s']:,.0f} tok/s; bound {r['bound_ms']:.3f} ms "
          f"(fraction {r['bound_fraction']:.3f}); kernels {r['kernel_us'] / 1e3:.3f} ms")
    print_kernels(r, top)


def print_kernels(r: dict, top: int) -> None:
    total = sum(r["kinds"].values()) or 1.0
    graph = r.get("graph_kinds") or {}
    print("| part | us / step | share |" + (" in the CUDA graph, us |" if graph else ""))
    print("|---|---|---|" + ("---|" if graph else ""))
    for kind, us in r["kinds"].items():
        print(f"| {kind} | {us:.1f} | {100 * us / total:.1f}% |"
              + (f" {graph.get(kind, 0.0):.1f} |" if graph else ""))
    print("\n| kernel | launches | us | share |")
    print("|---|---|---|---|")
    for k in r["kernels"][:top]:
        print(f"| {k['kernel'][:70]} | {k['launches']:.0f} | {k['us']:.1f} | "
              f"{100 * k['share']:.1f}% |")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    batches = batch_sizes(args)
    if not torch.cuda.is_available():
        raise SystemExit("error: the profile needs a CUDA GPU (kernel times come from CUPTI)")
    from minisparse.models.loading import load_policy

    cfg = bench_config(args)
    model, tokenizer = load_policy(cfg.model.path, "bfloat16", "cuda")
    model.eval()
    engine = LLMEngine(model, tokenizer, cfg.engine, cfg.compress, "cuda")
    sp = SamplingParams.from_config(cfg, 1, 1, 0)
    bandwidth = copy_bandwidth("cuda")
    weights, kv = weight_bytes_per_step(model), kv_bytes_per_token(model.config, model.dtype)
    bound = max_cache_tokens(cfg.compress)
    length = min(args.cache_len, bound) if bound else args.cache_len
    print(f"{torch.cuda.get_device_name()}, model {cfg.model.path}, compress "
          f"{cfg.compress.algorithm}, fused kernels {cfg.engine.fused_kernels}, copy "
          f"{bandwidth / 1e9:.0f} GB/s, weights {weights / 1e9:.2f} GB, "
          f"{kv} KV bytes a token")
    result = dict(model=cfg.model.path, compress=cfg.compress.algorithm,
                  fused_kernels=cfg.engine.fused_kernels, copy_gbs=bandwidth / 1e9, steps=[])
    for b in batches:
        r = profile_batch(engine, b, length, args, sp, bandwidth, weights, kv)
        print_step(r, args.top)
        result["steps"].append(r)
        for fused in compaction_modes(engine, args.compaction_scoring):
            c = profile_compaction(engine, b, fused)
            print(f"\n## compaction of {b} sequences at {c['cache_len']} entries, scored "
                  f"{'by the fused kernel' if fused else 'by the rule'}: {c['ms']:.3f} ms "
                  f"({c['ms'] / r['step_ms']:.1f} decode steps)")
            print_kernels(c, args.top)
            result.setdefault("compaction", []).append(c)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
