"""Reports which share of each prompt part a compressed rollout still caches at the end.

Samples held-out arithmetic prompts with compression on, follows every (sequence, layer,
KV head)'s kept positions through each compaction, and reports which share of each prompt
part (system turn, question, instruction) is still cached at the end, and at which
response token compression starts.

    python -m scripts.kv_retention --model checkpoints/smollm2-135m-instruct \
        --config smollm2_rkv --prompts 16 --max-new 300
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from minisparse.data.benchmarks import load_benchmark
from minisparse.config.load import load_config
from minisparse.data.synthetic import Difficulty
from minisparse.engine import SamplingParams, engine as engine_mod
from minisparse.engine.engine import LLMEngine
from minisparse.data.prompts import prompt_token_ids
from minisparse.models.loading import load_policy


class Positions:
    """Original positions each (slot, layer, head) holds, updated at every compaction."""

    def __init__(self, engine: LLMEngine) -> None:
        self.kept: dict[int, list] = {}  # slot -> [layer][head] -> positions
        self.first: dict[int, int] = {}  # slot -> next_pos at its first compaction
        self.selected: list[torch.Tensor] = []
        real_select, real_compact = engine.rule.select_batch, engine_mod.compact
        self.layers = engine.lm.num_layers

        def select(*a, **k):
            self.selected.append(real_select(*a, **k))
            return self.selected[-1]

        def compact(pool, rule, rows, lens, next_pos, protected=None):
            real_compact(pool, rule, rows, lens, next_pos, protected)
            self.update(rows, lens, next_pos, protected or [0] * len(rows))

        engine.rule.select_batch = select
        engine_mod.compact = compact

    def update(self, rows, lens, next_pos, protected) -> None:
        """protected[i]: leading entries of rows[i] that stayed (compress.keep_prompt)."""
        keep = torch.cat(self.selected).cpu()
        self.selected.clear()
        keep = keep.view(len(rows), self.layers, keep.shape[1], keep.shape[2])
        for i, slot in enumerate(rows):
            fresh = list(range(next_pos[i] - lens[i], next_pos[i]))
            if slot not in self.kept:
                self.first[slot] = next_pos[i]
                self.kept[slot] = [[fresh] * keep.shape[2] for _ in range(self.layers)]
            first = protected[i]
            for layer in range(self.layers):
                # the entries kept last time, then the tokens appended since
                self.kept[slot][layer] = [
                    head[:first] + [(head + fresh[len(head):])[j] for j in idx]
                    for head, idx in zip(self.kept[slot][layer], keep[i, layer].tolist())]


def spans(tokenizer, ids: list[int]) -> dict[str, list[int]]:
    """Prompt token indices of the system turn, the question and the instruction."""
    text, parts = "", defaultdict(list)
    for i, t in enumerate(ids):
        text += tokenizer.decode([t])
        if "What is" not in text:
            parts["system + user header"].append(i)
        elif "$?" not in text:
            parts["question"].append(i)
        elif "<|im_end|>" not in text[text.index("$?"):]:
            parts["instruction (\\boxed{})"].append(i)
        else:
            parts["turn end + assistant header"].append(i)
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", default="smollm2_rkv")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=300)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    cfg = load_config(args.config, [f"model.path={args.model}"])
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    model, tok = load_policy(args.model, dtype, args.device)
    engine = LLMEngine(model, tok, cfg.engine, cfg.compress, args.device)
    tracker = Positions(engine)
    problems = load_benchmark("arithmetic", "", args.prompts, Difficulty.from_config(cfg.data))
    prompts = [prompt_token_ids(tok, p.question, "user") for p in problems]
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=args.max_new,
                                                   seed=0))
    # all prompts are admitted at once, in order, so prompt i holds slot i (free slots
    # are handed out lowest first); one that ended before any compaction has no entry
    slot_of = {i: i for i in range(len(prompts)) if i in tracker.kept}
    share: dict[str, list[float]] = defaultdict(list)
    starts = []
    for i, p in enumerate(prompts):
        slot = slot_of.get(i)
        if slot is None:
            continue
        starts.append(tracker.first[slot] - len(p))
        heads = [set(h) for layer in tracker.kept[slot] for h in layer]
        for name, idx in spans(tok, p).items():
            share[name].append(sum(len(h & set(idx)) for h in heads) / (len(heads) * len(idx)))
    report = {
        "prompts": len(prompts), "compressed": len(starts),
        "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
        "response_tokens_mean": sum(len(o.token_ids) for o in outs) / len(outs),
        "first_compression_at_response_token": sorted(starts),
        "kept_share_at_end": {k: round(sum(v) / len(v), 3) for k, v in share.items()},
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
