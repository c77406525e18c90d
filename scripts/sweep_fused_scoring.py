"""One compaction event scored by the fused kernel (engine/triton_scores) at each --tiles
setting, against the rule's own path, alternating --repeats times: where the kernel's
tiles and compaction's size cap (_FUSED_MAX_WORK) come from.

    python -m scripts.sweep_fused_scoring --algorithm rkv --events 224x16,224x64,224x256 \
        --tiles 32,64,32,2,1 --tiles 32,64,32,2,0 --tiles 64,64,64,4,0
    python -m scripts.sweep_fused_scoring --algorithm rkv --tiles 32,64,32,2,1 \
        --events 224x64,224x128,224x256,320x64,320x128,640x8,640x16,640x32

An event of LxS compacts S sequences of L cache entries each to the rule's budget: L - 32
up to 256 entries (192 / 32 at 224), else L - L // 5 (256 / 64 at 320, 512 / 128 at 640). A tile is BLOCK_N,BLOCK_M,BLOCK_R,warps,split (split 1: R-KV's
search as its own launch; see triton_scores._TILES). The event ignores the size cap (the
kernel scores every event here). --keys random fills each cache with independent random
keys, which no two of are similar enough for R-KV's search to stop early; shared adds one
direction per layer and head to every key, as real keys share one, so the search stops at
its first block. Random weights of --model (decode speed and compaction do not depend on
the weights; the caches are filled here). Milliseconds, median of 10 calls a repeat (CUDA
events), then the median over the repeats; --device cpu runs the kernel under Triton's
interpreter (TRITON_INTERPRET=1), to check the sweep itself, not to time it.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator

import torch

from minisparse.bench.bound import median_seconds
from minisparse.bench.profile import build_parser, fill_caches
from minisparse.bench.run import bench_config
from minisparse.compression import build_rule
from minisparse.config.schema import CompressConfig
from minisparse.engine import LLMEngine, compaction
from minisparse.engine.compaction import compact


def _tiles(text: str) -> tuple[int, int, int, int, bool]:
    n, m, r, warps, split = (int(x) for x in text.split(","))
    return n, m, r, warps, bool(split)


def _events(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in e.split("x")) for e in text.split(",")]


def fill(engine: LLMEngine, sequences: int, entries: int, keys: str) -> None:
    """Caches of `entries` random K/V on scattered pages (profile.fill_caches); shared:
    plus one direction per layer and KV head in every key."""
    pool = engine.pool
    fill_caches(engine, sequences, entries)
    pool.q_ring.normal_(0, 1)
    if keys == "shared":
        direction = torch.randn(pool.k.shape[0], 1, *pool.k.shape[2:], device=pool.k.device)
        pool.k.mul_(0.6).add_(direction)


def event_ms(engine: LLMEngine, rule, sequences: int, entries: int, fused: bool) -> float:
    rows, lens = list(range(sequences)), [entries] * sequences

    def event():
        compact(engine.pool, rule, rows, lens, lens, fused=fused)

    if engine.pool.k.is_cuda:
        return 1e3 * median_seconds(event, 10)
    start = time.perf_counter()
    event()
    return 1e3 * (time.perf_counter() - start)


def sweep(engine: LLMEngine, algorithm: str, events: list[tuple[int, int]],
          tiles: list[tuple], keys: list[str], repeats: int) -> Iterator[list]:
    """[keys, entries, sequences, rule ms, ms at each of tiles] an event, as each is
    measured; the kernel's tiles and compaction's choice of scorer are back as they were
    once the sweep ends."""
    from minisparse.engine import triton_scores

    redundancy = algorithm == "rkv"
    shipped, choose = dict(triton_scores._TILES), compaction.fused_scorer
    compaction.fused_scorer = lambda *a: triton_scores  # every event size
    try:
        for kind in keys:
            for entries, sequences in events:
                budget = entries - (32 if entries <= 256 else entries // 5)
                rule = build_rule(CompressConfig(algorithm=algorithm, budget=budget,
                                                 divide_length=entries - budget))
                fill(engine, sequences, entries, kind)
                times: dict[object, list[float]] = {}
                for _ in range(repeats):
                    times.setdefault("rule", []).append(
                        event_ms(engine, rule, sequences, entries, False))
                    for t in tiles:
                        triton_scores._TILES = {redundancy: t, not redundancy: t}
                        times.setdefault(t, []).append(
                            event_ms(engine, rule, sequences, entries, True))
                yield [kind, entries, sequences,
                       *(statistics.median(times[k]) for k in ["rule", *tiles])]
    finally:
        triton_scores._TILES, compaction.fused_scorer = shipped, choose


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithm", choices=("rkv", "snapkv"), default="rkv")
    p.add_argument("--events", default="224x16,224x64,224x256", help="LxS, comma-separated")
    p.add_argument("--tiles", action="append", type=_tiles,
                   help="BLOCK_N,BLOCK_M,BLOCK_R,warps,split (repeatable; default: shipped)")
    p.add_argument("--keys", default="random,shared")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: no CUDA GPU here")
    from minisparse.engine import triton_scores
    from minisparse.models.loading import load_policy

    events = _events(args.events)
    longest, most = max(e for e, _ in events), max(s for _, s in events)
    bench = build_parser().parse_args(
        ["--model", args.model, "--batch", str(most), "--compress", args.algorithm,
         "--budget", str(longest - 1), "--divide-length", "1", "--max-num-seqs", str(most)])
    cfg = bench_config(bench)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    model, tokenizer = load_policy(cfg.model.path, dtype, args.device)
    engine = LLMEngine(model, tokenizer, cfg.engine, cfg.compress, args.device)
    tiles = args.tiles or [triton_scores._TILES[args.algorithm == "rkv"]]
    print(f"{args.algorithm}, ms an event (median of {args.repeats} repeats)")
    print("| keys | entries x sequences | rule | " + " | ".join(map(str, tiles)) + " |")
    print("|---" * (len(tiles) + 3) + "|")
    with torch.inference_mode():
        for kind, entries, sequences, *ms in sweep(engine, args.algorithm, events, tiles,
                                                   args.keys.split(","), args.repeats):
            print(f"| {kind} | {entries} x {sequences} | "
                  + " | ".join(f"{x:.3f}" for x in ms) + " |", flush=True)


if __name__ == "__main__":
    main()
