"""Where a decode step's time goes: `python scripts/profile_engine.py --model qwen2.5-3b
--batch 256 --prompt-len 160 --max-new 1024 [--compress rkv] [--steps 64] [--warmup 128]`.

Runs the bench workload (minisparse.engine.bench; every bench flag is accepted) and, in one
generate() call, after --warmup decode steps:
  1. times --steps decode steps, each split into model forward (graph replay or eager),
     logits + sampling (to the host copy of the tokens; inside the graph when the step is
     a graph replay, so then "forward" includes them), compression (wall, when it fires)
     and host (the rest of the step's wall time: scheduling, tensor building, bookkeeping,
     i.e. time the GPU waits for Python). On CUDA the first two are CUDA-event times.
  2. runs torch.profiler over the next --steps decode steps and prints the top kernels by
     total device time (CPU ops by self time when there is no GPU).
Then stops the generation (the rest of --max-new is not run). Output is kept short.
Steps run without overlap (overlap_decode off), so that each one can be split.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minisparse.engine import bench, model_runner
from minisparse.engine import engine as engine_mod


class _Stop(Exception):
    pass


class _Clock:
    """A point in time: a CUDA event on CUDA, perf_counter on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    p.add_argument("--steps", type=int, default=64, help="decode steps timed, then profiled")
    p.add_argument("--warmup", type=int, default=128, help="decode steps before timing")
    p.add_argument("--top", type=int, default=25, help="kernels listed")
    p.add_argument("--no-profiler", action="store_true", help="timing only")
    ours, rest = p.parse_known_args(argv)
    args = bench.parse_args(rest)
    cuda = args.device.startswith("cuda")
    engine, prompts, params, dtype = bench.build(args)
    clock = _Clock(cuda)
    runner = engine.runner
    state = {"decode_steps": 0, "rec": None, "prof": None, "decoded": False}
    rows: list[dict] = []
    first, last_timed = ours.warmup, ours.warmup + ours.steps
    last_prof = last_timed + (0 if ours.no_profiler else ours.steps)

    real_step, real_launch = engine._step, runner.launch
    real_sample, real_collect, real_compress = runner._sample, runner.collect, engine._compress
    engine.cfg.overlap_decode = False  # one decode step per _step, so each can be split

    def launch(seqs, sp, inputs):
        state["decoded"] = True
        rec = state["rec"]
        if rec is not None:
            rec["batch"] = len(seqs)
        return real_launch(seqs, sp, inputs)

    def forward_start(fn):
        def wrapped(*a, **k):
            rec = state["rec"]
            if rec is not None and "t0" not in rec:
                rec["t0"] = clock.mark()
            return fn(*a, **k)
        return wrapped

    def timed_sample(real):
        def wrapped(*a, **k):
            rec = state["rec"]
            if rec is None or "t0" not in rec or "t1" in rec:
                return real(*a, **k)
            rec["t1"] = clock.mark()
            out = real(*a, **k)
            rec["t2"] = clock.mark()
            return out
        return wrapped

    def compress(*a, **k):
        rec = state["rec"]
        if rec is None:
            return real_compress(*a, **k)
        t = time.perf_counter()
        out = real_compress(*a, **k)
        if cuda:
            torch.cuda.synchronize()
        rec["compress_ms"] = rec.get("compress_ms", 0.0) + (time.perf_counter() - t) * 1e3
        return out

    def step(*a, **k):
        n = state["decode_steps"]
        if n == first + ours.steps and not ours.no_profiler and state["prof"] is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            state["prof"] = torch.profiler.profile(activities=acts)
            state["prof"].__enter__()
        timed = first <= n < last_timed
        state["decoded"] = False
        state["rec"] = rec = {} if timed else None
        if cuda and timed:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = real_step(*a, **k)
        if cuda and timed:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3
        if rec is not None and state["decoded"]:
            fwd = clock.ms(rec["t0"], rec["t1"])
            smp = clock.ms(rec["t1"], rec["t2"])
            comp = rec.get("compress_ms", 0.0)
            rows.append({"wall": wall, "fwd": fwd, "sample": smp, "compress": comp,
                         "host": wall - fwd - smp - comp, "batch": rec["batch"],
                         "fired": rec.get("fired", False)})
        state["decode_steps"] = n + state["decoded"]
        state["rec"] = None
        if state["decode_steps"] >= last_prof:
            raise _Stop
        return out

    real_compact = engine_mod.compact

    def compact(*a, **k):
        if state["rec"] is not None:
            state["rec"]["fired"] = True
        return real_compact(*a, **k)

    engine_mod.compact = compact
    runner.launch = launch
    runner._sample, runner.collect = timed_sample(real_sample), timed_sample(real_collect)
    if runner.graphs is not None:
        runner.graphs.run = forward_start(runner.graphs.run)
    model_runner.decode_forward = forward_start(model_runner.decode_forward)
    engine._step, engine._compress = step, compress

    t = time.perf_counter()
    try:
        engine.generate(prompts, params)
        stopped = False
    except _Stop:
        stopped = True
    total = time.perf_counter() - t
    prof = state["prof"]
    if prof is not None:
        if cuda:
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)

    print(f"[profile] model={args.model} dtype={dtype} device={args.device} batch={args.batch} "
          f"prompt={args.prompt_len} compress={args.compress} T={args.temperature} "
          f"top_p={args.top_p} top_k={args.top_k} graphs={not args.no_cuda_graphs} "
          f"decode steps seen={state['decode_steps']} stopped early={stopped} "
          f"({total:.1f}s)")
    if rows:
        _print_steps(rows, cuda)
    else:
        print("[profile] no decode step was timed (raise --max-new or lower --warmup)")
    if prof is not None:
        _print_kernels(prof, cuda, ours.top)


def _print_steps(rows: list[dict], cuda: bool) -> None:
    keys = ("wall", "fwd", "sample", "compress", "host")
    gpu = " (gpu)" if cuda else ""
    label = {"wall": "step wall", "fwd": "forward (+sample in graph)" + gpu,
             "sample": "sample+d2h (d2h in graph)" + gpu, "compress": "compression (wall)",
             "host": "host/python (rest)"}
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    mean = {k: statistics.fmean(r[k] for r in rows) for k in keys}
    low = {k: min(r[k] for r in rows) for k in keys}
    fired = sum(r["fired"] for r in rows)
    B = statistics.median(r["batch"] for r in rows)
    print(f"[steps] {len(rows)} decode steps timed, batch {B:.0f}; ms per step "
          f"(median / min / mean / share of mean wall):")
    for k in keys:
        share = 100 * mean[k] / max(mean["wall"], 1e-9)
        print(f"  {label[k]:<28} {med[k]:9.3f} {low[k]:9.3f} {mean[k]:9.3f} {share:6.1f}%")
    print(f"  compression fired in {fired} steps; decode tok/s at median step: "
          f"{B / max(med['wall'], 1e-9) * 1e3:.0f}")


def _print_kernels(prof, cuda: bool, top: int) -> None:
    events = prof.key_averages()

    def dev_self(e):
        for name in ("self_device_time_total", "self_cuda_time_total"):
            if hasattr(e, name):
                return getattr(e, name)
        return 0.0

    if cuda:
        rows = [(dev_self(e), e.count, e.key) for e in events if dev_self(e) > 0]
        what = "device kernels (self device time)"
    else:
        rows = [(e.self_cpu_time_total, e.count, e.key) for e in events]
        what = "CPU ops (self CPU time)"
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows) or 1.0
    print(f"[kernels] top {min(top, len(rows))} {what}; total {total / 1e3:.1f} ms over the "
          f"profiled steps")
    print(f"  {'ms':>9} {'%':>5} {'calls':>6}  name")
    for t, n, name in rows[:top]:
        name = name if len(name) <= 90 else name[:87] + "..."
        print(f"  {t / 1e3:9.2f} {100 * t / total:5.1f} {n:6d}  {name}")


if __name__ == "__main__":
    main()
