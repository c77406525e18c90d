"""Rollout throughput benchmark: tokens/s of the rollout engine on random prompts, against
SGLang's on the same workload with --backend both.

    python -m minisparse.bench --model qwen2.5-3b --device cuda --batch 256 \
        --prompt-len 256 --max-new-tokens 2048 --compress rkv --budget 512

Random seeded prompts, EOS ignored so every sequence runs to --max-new-tokens. Prints one
summary line per timed run (after an untimed warm-up) and writes the median run's numbers,
plus every run's, to --json. `--backend sglang` runs the same workload through the
embedded SGLang engine (dense only); `--backend both` runs native then SGLang in one
process and prints the native/SGLang throughput ratio. With --compress, `both` runs the
native engine compressed and SGLang dense (it has no compressed cache): the ratio is then
what sparse rollouts gain over the dense reference on the same prompts and lengths.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch

from minisparse.compression import check_rule, evictable_len, max_cache_tokens
from minisparse.compression.trigger import unreachable
from minisparse.config.cli import (ENGINE_KEYS, HelpFormatter, add_config_flags, config_overrides,
                                   flag_name)
from minisparse.config.load import config_value, load_config, section_keys
from minisparse.config.schema import Backend, CompressConfig, Config, ConfigError, Dtype, choices
from minisparse.bench.bound import (copy_bandwidth, decode_bound, decode_roofline,
                                    matmul_throughput, weight_bytes_per_step)
from minisparse.engine import GenerateStats, LLMEngine, SamplingParams
from minisparse.models.loading import kv_bytes_per_token

# Config keys with a flag; the run's Config is the schema's defaults with the given ones.
CONFIG_KEYS = ("model.path", "temperature", "top_p", "top_k", *section_keys("compress"),
               *ENGINE_KEYS)


def build_parser() -> argparse.ArgumentParser:
    """The bench's own flags, then one per CONFIG_KEYS key."""
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog="python -m minisparse.bench", description=doc[0],
                                epilog=" ".join(doc[2:]), formatter_class=HelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the model and the KV cache live (default here: %(default)s; "
                        "cuda where available)")
    p.add_argument("--backend", default="native", choices=[*choices(Backend), "both"],
                   help="rollout engine; both: native, then SGLang dense, and their ratio")
    p.add_argument("--dtype", default=None, choices=choices(Dtype),
                   help="weights' dtype; default: bfloat16 on cuda, float32 on cpu")
    g = p.add_argument_group("workload")
    g.add_argument("--batch", type=int, default=64, help="number of prompts")
    g.add_argument("--samples-per-prompt", type=int, default=1,
                   help="samples per prompt (GRPO's n): sequences = batch x n")
    g.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt")
    g.add_argument("--max-new-tokens", type=int, default=512,
                   help="tokens every sequence generates (EOS is ignored)")
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts and the sampling")
    g = p.add_argument_group("timing and output")
    g.add_argument("--repeats", type=int, default=1,
                   help="timed runs; the JSON's top-level numbers are the median run's")
    g.add_argument("--warmup", type=int, default=32,
                   help="new tokens of an untimed first run (0: none)")
    g.add_argument("--copy-gbs", type=float, default=0.0,
                   help="copy bandwidth (GB/s, read + written) for the bound; 0: measure "
                        "on CUDA, no bound on CPU")
    g.add_argument("--matmul-tflops", type=float, default=0.0,
                   help="bf16 GEMM throughput (TFLOP/s) for the roofline; 0: measure on "
                        "CUDA, no roofline on CPU")
    g.add_argument("--json", default=None, help="write the results here")
    add_config_flags(p.add_argument_group(
        "model, sampling, compression and engine settings",
        "the run config's keys; flags left out keep the default shown"), CONFIG_KEYS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags checked before any model loads: a bad value, a device this torch lacks, a
    --compress rule that does not import or a compression that would never run exits 2
    naming it."""
    p = build_parser()
    args = p.parse_args(argv)
    try:
        cfg = bench_config(args)
    except ConfigError as exc:
        p.error(str(exc))
    problem = (device_problem(args.device) or rule_problem(cfg)
               or unreachable(cfg.compress, args.prompt_len, args.max_new_tokens, _flag))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    return args


def _flag(key: str) -> str:
    """A config key as this command's flag (the response length is --max-new-tokens)."""
    return "--max-new-tokens" if key == "max_response_len" else "--" + flag_name(key)


def device_problem(device: str) -> str | None:
    """Why this torch cannot run on `device` (None when it can): one line, not the
    traceback torch raises at the first tensor."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
        return (f"--device {device}: torch {torch.__version__} has no CUDA here ({build}); "
                f"use --device cpu")
    return None


def rule_problem(cfg: Config) -> str | None:
    """Why --compress names no usable rule (None when it does): one line, like the rest."""
    try:
        check_rule(cfg.compress)
    except ConfigError as exc:
        return str(exc)
    return None


def bench_config(args: argparse.Namespace) -> Config:
    """The schema's defaults with the given config flags, checked like any config."""
    return load_config(None, config_overrides(args, CONFIG_KEYS))


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Seeded token ids, kept clear of the top of the vocabulary (special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, max(11, vocab - 512), (n, length), generator=g).tolist()


def build(args: argparse.Namespace, backend: str = "native"):
    """(engine, prompts, params, dtype) for the bench workload described by args."""
    from minisparse.models.loading import load_policy

    cfg = bench_config(args)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    model, tokenizer = load_policy(cfg.model.path, dtype, args.device)
    model.eval()
    compress, engine_cfg = cfg.compress, cfg.engine
    if backend == "sglang":
        from minisparse.engine.sglang_backend import SGLangBackend

        if args.backend == "both":  # the dense reference of a compressed native run
            compress = CompressConfig()
        engine = SGLangBackend(model, tokenizer, engine_cfg, compress, args.device, dtype,
                               seed=args.seed)
        engine.update_weights(model)  # the same random weights as the native run
    else:
        engine = LLMEngine(model, tokenizer, engine_cfg, compress, args.device)
    prompts = random_prompts(args.batch, args.prompt_len, model.config.vocab_size, args.seed)
    params = SamplingParams.from_config(cfg, args.samples_per_prompt, args.max_new_tokens,
                                        args.seed)
    return engine, prompts, dataclasses.replace(params, ignore_eos=True), dtype


def warmup_tokens(args: argparse.Namespace) -> int:
    """--warmup, raised with compression on until the second compression event has run, so
    its kernels' compilation is not timed either (else a one-run bench pays it). Two events:
    the first compresses caches of whatever length first passes the budget (513 for R-KV
    512/128 after a 160-token prompt), later ones caches at the cap (640), and Triton
    compiles its kernels again for the new lengths (~1.1 s on an H200, seen in every
    first timed run while the warm-up stopped after one event)."""
    compress = bench_config(args).compress
    bound = max_cache_tokens(compress, args.prompt_len)
    if not args.warmup or bound is None:
        return args.warmup
    # in what the trigger counts (keep_prompt: the response part alone)
    bound, prompt = (evictable_len(compress, n, args.prompt_len)
                     for n in (bound, args.prompt_len))
    return max(args.warmup, 2 * bound - compress.budget - prompt + 2)


def median_run(runs: list[dict]) -> dict:
    """The repeat with the median tokens/s (the upper median for an even count)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]


def run(args: argparse.Namespace) -> dict:
    """One backend's result, or with --backend both each one's and native_over_sglang."""
    if args.copy_gbs <= 0 and args.device.startswith("cuda"):
        args.copy_gbs = copy_bandwidth(args.device) / 1e9
        print(f"[bench] device-to-device copy: {args.copy_gbs:.0f} GB/s (read + written)",
              flush=True)
    if args.matmul_tflops <= 0 and args.device.startswith("cuda"):
        args.matmul_tflops = matmul_throughput(args.device) / 1e12
        print(f"[bench] bf16 8192^3 GEMM: {args.matmul_tflops:.0f} TFLOP/s", flush=True)
    if args.backend != "both":
        result = run_backend(args, args.backend)
    else:
        native, sglang = run_backend(args, "native"), run_backend(args, "sglang")
        ratio = native["tokens_per_s"] / max(sglang["tokens_per_s"], 1e-9)
        algorithm = bench_config(args).compress.algorithm
        print(f"[bench] native ({algorithm}) {native['tokens_per_s']:.0f} tok/s, sglang "
              f"(dense) {sglang['tokens_per_s']:.0f} tok/s: native/sglang = {ratio:.3f}",
              flush=True)
        result = dict(native=native, sglang=sglang, native_over_sglang=ratio)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def run_backend(args: argparse.Namespace, backend: str) -> dict:
    """Warm-up and timed repeats on one backend; its GPU memory is given back after."""
    engine, prompts, params, dtype = build(args, backend)
    cfg = bench_config(args)
    model = engine.lm.model if backend == "native" else None
    if args.warmup:  # graph capture and kernel compilation stay out of the timed runs
        engine.generate(prompts, dataclasses.replace(params, max_new_tokens=warmup_tokens(args)))
    runs = []
    for r in range(args.repeats):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        outs = engine.generate(prompts, params)
        s = engine.last_stats
        runs.append(dict(
            tokens_per_s=s.tokens_per_s, generated_tokens=s.generated_tokens, wall_s=s.wall_s,
            peak_kv_tokens=s.peak_kv_tokens,
            peak_kv_tokens_per_seq=max(o.peak_cache_tokens for o in outs),
            peak_pages_used=s.peak_pages_used, preemptions=s.preemptions,
            compressions=s.compressions, evicted_tokens=s.evicted_tokens,
            prefill_tokens=s.prefill_tokens, shared_prompt_tokens=s.shared_prompt_tokens,
            **phase_split(s),
            peak_gpu_memory_gb=(torch.cuda.max_memory_allocated() / 2**30
                                if args.device.startswith("cuda") else 0.0),
            device_used_gb=device_used_gb(args.device)))
        if model is not None and args.copy_gbs > 0:
            weights = weight_bytes_per_step(model)
            kv = kv_bytes_per_token(model.config, model.dtype)
            runs[-1].update(decode_bound(s, weights, kv, args.copy_gbs * 1e9))
            if args.matmul_tflops > 0:
                runs[-1].update(decode_roofline(s, weights, model.dtype.itemsize, kv,
                                                args.copy_gbs * 1e9, args.matmul_tflops * 1e12))
        if backend == "native":
            p = runs[-1]
            print(f"[phases {r + 1}/{args.repeats}] device time: decode {p['decode_s']:.2f}s, "
                  f"compression {p['compress_s']:.2f}s ({100 * p['compress_share']:.1f}% of "
                  f"wall, {p['compress_events']} events), prefill {p['prefill_s']:.2f}s "
                  f"({p['prefill_steps']} steps, {p['prefill_tokens']} tokens, "
                  f"{p['shared_prompt_tokens']} shared); "
                  f"host-bound rest {p['host_s']:.2f}s; CUDA graphs {p['graph_steps']} of "
                  f"{p['decode_steps']} decode steps, fused kernels "
                  f"{'on' if p['fused_kernels'] else 'off'}", flush=True)
        algorithm = "none" if backend == "sglang" else cfg.compress.algorithm  # SGLang: dense
        print(f"[bench {r + 1}/{args.repeats}] {backend} model={cfg.model.path} "
              f"compress={algorithm} batch={args.batch}x{args.samples_per_prompt} "
              f"prompt={args.prompt_len} new={args.max_new_tokens}: "
              f"{s.tokens_per_s:.0f} tok/s, {s.generated_tokens} tok in {s.wall_s:.2f}s, "
              f"peak kv {s.peak_kv_tokens} tok (per seq {runs[-1]['peak_kv_tokens_per_seq']}, "
              f"{s.peak_pages_used} pages), "
              f"preemptions {s.preemptions}, compressions {s.compressions}"
              + (f", gpu peak {runs[-1]['peak_gpu_memory_gb']:.1f} GiB (this process), "
                 f"{runs[-1]['device_used_gb']:.1f} GiB in use on the device"
                 if args.device.startswith("cuda") else "")
              + (f", bound {runs[-1]['bound_tokens_per_s']:.0f} tok/s "
                 f"(fraction {runs[-1]['bound_fraction']:.3f})" if "bound_fraction" in runs[-1]
                 else "")
              + (f", roofline {runs[-1]['roofline_tokens_per_s']:.0f} tok/s "
                 f"(fraction {runs[-1]['roofline_fraction']:.3f})"
                 if "roofline_fraction" in runs[-1] else ""), flush=True)
    pool = getattr(engine, "pool", None)  # the native engine's; SGLang sizes its own
    lm = getattr(engine, "lm", None)  # the native engine's fused qkv / gate-up copy
    result = dict(median_run(runs), runs=runs, backend=backend,
                  fused_weights_gb=lm.fused_bytes / 2**30 if lm is not None else 0.0,
                  pool_pages=pool.num_pages if pool else 0,
                  pool_tokens=pool.num_pages * pool.page_size if pool else 0,
                  config=run_settings(args, cfg) | {"dtype": dtype},
                  time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    if backend == "sglang":
        engine.shutdown()
    else:
        engine.sleep()
    del engine
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def run_settings(args: argparse.Namespace, cfg: Config) -> dict:
    """What the JSON records of the run: the bench's own flags and every config key that
    has a flag, given or not."""
    own = {k: v for k, v in vars(args).items() if k != "json" and k not in CONFIG_KEYS}
    return own | {key: config_value(cfg, key) for key in CONFIG_KEYS}


def phase_split(s: GenerateStats) -> dict:
    """Where the run's wall time went: the engine's per-phase device time, and the rest
    (the device waiting for the host: scheduling, bookkeeping, launches)."""
    phases = dict(prefill_s=s.prefill_s, decode_s=s.decode_s, compress_s=s.compress_s)
    return dict(phases, compress_events=s.compress_events, decode_steps=s.decode_steps,
                prefill_steps=s.prefill_steps,
                graph_steps=s.graph_steps, fused_kernels=s.fused_kernels,
                compress_share=s.compress_s / max(s.wall_s, 1e-9),
                host_s=max(0.0, s.wall_s - sum(phases.values())))


def device_used_gb(device: str) -> float:
    """Memory in use on the whole GPU: SGLang holds its pool in a subprocess, which the
    allocator's own peak cannot see, so the two backends compare only on this figure."""
    if not device.startswith("cuda"):
        return 0.0
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return (total - free) / 2**30


def main(argv: list[str] | None = None) -> None:
    """Like train.py and eval.py, a missing SGLang fails before any model is loaded (and,
    with --backend both, before the native run it would otherwise spend)."""
    args = parse_args(argv)
    if args.backend != "native":
        from minisparse.engine.sglang_backend import SGLangMissingError, require_sglang

        try:
            require_sglang()
        except SGLangMissingError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
    run(args)


if __name__ == "__main__":
    main()
