"""A rollout's prefill steps with the SDPA kernel the engine picks (memory-efficient) and
with torch's own choice (cuDNN first, for a masked call), in one process on one GPU.

    python -m scripts.bench_prefill_sdpa --model <an HF directory> --prompts 128 --pairs 3

After an untimed rollout of 16 other prompts (kernel builds, graph captures), each pair
samples --samples-per-prompt answers for --prompts prompts of the data file that no
earlier run has seen, torch's choice first, then the engine's: a rollout of a GRPO run
meets new prompts, so new prefill shapes (chunks x longest chunk x cache length), and
cuDNN builds a plan for each shape it has not seen. The engine's run of the pair sees the
same shapes again, which would help only cuDNN. The engine is the config's
(512 slots for the paper's 1,024 samples: the first answers to end make room for the
rest, one admission at a time); --compress keeps the config's compression, else dense.
On a CPU (`--model tiny`) both runs take torch's CPU kernel: it only checks the loop.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics

import torch

import minisparse.engine.layers.attention as attention
from minisparse.config.load import load_config
from minisparse.data.datasets import read_rows, render_prompt
from minisparse.engine import LLMEngine, SamplingParams
from minisparse.models.loading import load_policy
from minisparse.trainer.measure import timed

ARMS = ("torch", "engine")  # torch's SDPA choice, then the engine's (prefill_sdpa)
WARMUP_PROMPTS = 16  # an untimed first rollout, on prompts no timed run gets


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.bench_prefill_sdpa",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an HF directory, or a shape name")
    p.add_argument("--config", default="qwen1.5b_rkv", help="engine and sampling settings")
    p.add_argument("--data", default="data/simplelr_qwen_level3to5.jsonl",
                   help="a {prompt, label} file (rows used in order)")
    p.add_argument("--prompts", type=int, default=128, help="prompts a run")
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--pairs", type=int, default=3, help="pairs of runs, fresh prompts each")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--compress", action="store_true", help="keep the config's compression")
    p.add_argument("--json", default=None, help="write each run's figures here")
    return p.parse_args(argv)


def read_prompts(path: str, n: int, tokenizer) -> list[list[int]]:
    """The file's first n usable prompts as training renders them."""
    prompts = []
    for prompt, _ in read_rows(path):
        prompts.append(render_prompt(prompt, tokenizer))
        if len(prompts) == n:
            return prompts
    raise SystemExit(f"error: {path} has {len(prompts)} usable row(s); the runs need {n} "
                     f"(--prompts x --pairs, and {WARMUP_PROMPTS} to warm up)")


def run_once(engine: LLMEngine, prompts: list[list[int]], sp: SamplingParams,
             arm: str) -> dict:
    """One generate() with the arm's prefill kernels; its wall time and phase split."""
    chosen = attention.prefill_sdpa
    if arm == "torch":
        attention.prefill_sdpa = lambda device: contextlib.nullcontext()
    try:
        wall = timed(lambda: engine.generate(prompts, sp), engine.device)
    finally:
        attention.prefill_sdpa = chosen
    s = engine.last_stats
    steps = s.steps - s.decode_steps
    return dict(arm=arm, wall_s=wall, prefill_s=s.prefill_s, prefill_steps=steps,
                prefill_ms_per_step=s.prefill_s / max(steps, 1) * 1e3,
                prefill_tokens=s.prefill_tokens, decode_s=s.decode_s,
                compress_s=s.compress_s, generated_tokens=s.generated_tokens)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = load_config(args.config)
    compress = cfg.compress if args.compress else dataclasses.replace(cfg.compress,
                                                                      algorithm="none")
    model, tokenizer = load_policy(args.model, "bfloat16" if device == "cuda" else "float32",
                                   device)
    model.eval()
    engine = LLMEngine(model, tokenizer, cfg.engine, compress, device)
    prompts = read_prompts(args.data, args.prompts * args.pairs + WARMUP_PROMPTS, tokenizer)
    warm = SamplingParams(max_new_tokens=min(args.max_new_tokens, 300), n=2, seed=99)
    engine.generate(prompts[-WARMUP_PROMPTS:], warm)  # kernel builds, graph captures: untimed
    runs = []
    for pair in range(args.pairs):
        batch = prompts[pair * args.prompts:(pair + 1) * args.prompts]
        sp = SamplingParams(max_new_tokens=args.max_new_tokens, n=args.samples_per_prompt,
                            seed=pair)  # the engine stops each answer at the model's EOS
        for arm in ARMS:
            r = dict(pair=pair, **run_once(engine, batch, sp, arm))
            runs.append(r)
            print(f"pair {pair} {arm:6s}: rollout {r['wall_s']:.2f} s, prefill "
                  f"{r['prefill_s']:.2f} s in {r['prefill_steps']} steps "
                  f"({r['prefill_ms_per_step']:.0f} ms each), decode {r['decode_s']:.2f} s",
                  flush=True)
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        print(f"{arm}: median rollout {statistics.median(r['wall_s'] for r in mine):.2f} s, "
              f"prefill step {statistics.median(r['prefill_ms_per_step'] for r in mine):.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, config=args.config, device=device,
                           runs=runs), f, indent=1)


if __name__ == "__main__":
    main()
