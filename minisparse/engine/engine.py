"""LLMEngine: the rollout engine. Owns the KV pool, scheduler and model runner, and runs
the step loop: prefill (chunked) whenever waiting sequences fit, else one decode step for
every running sequence; after each step, append sampled tokens, finish sequences, and
compress the caches that the trigger marks due.
"""
from __future__ import annotations

import random
import time

import torch
from torch import nn

from minisparse.compression import build_policy, compress_due, max_cache_tokens, newline_token_ids
from minisparse.engine.page_allocator import PageAllocator
from minisparse.engine.compaction import compact
from minisparse.config import CompressConfig, EngineConfig
from minisparse.engine.config import SamplingParams
from minisparse.engine.kv_pool import KVPool
from minisparse.engine.layers.sampler import seed_for
from minisparse.engine.model_runner import ModelRunner
from minisparse.engine.models import CausalLM
from minisparse.engine.scheduler import Scheduler
from minisparse.engine.sequence import GenerateStats, SampleOutput, Sequence


# End-of-turn / end-of-text markers of the supported families. A base checkpoint's eos is
# often <|endoftext|> alone while its RL prompts use the chat format, so a turn that ends
# with <|im_end|> would otherwise run on into an invented next turn.
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>", "<|end_of_text|>")


def eos_token_ids(model: nn.Module, tokenizer) -> set[int]:
    """Ids that end a sample (unless ignore_eos): the tokenizer's and generation_config's
    eos (either may list several) and the END_TOKENS the vocabulary has."""
    ids: set[int] = set()
    sources = (getattr(tokenizer, "eos_token_id", None),
               getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    for x in sources:
        if x is not None:
            ids.update(x if isinstance(x, (list, tuple)) else [x])
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}  # None: ids-only use
    ids.update(vocab[t] for t in END_TOKENS if t in vocab)
    return ids


class LLMEngine:
    def __init__(self, model: nn.Module, tokenizer, cfg: EngineConfig,
                 compress: CompressConfig | None = None,
                 device: torch.device | str = "cpu") -> None:
        """cfg and compress are the run config's engine and compress sections (compress
        None or algorithm "none": dense rollouts)."""
        self.cfg, self.tokenizer = cfg, tokenizer
        self.compress = compress or CompressConfig()
        self.device = torch.device(device)
        self.lm = CausalLM(model)
        self.policy = build_policy(self.compress)  # None when dense
        self.pool = KVPool(self.lm, cfg, self.policy.window if self.policy else 0, self.device)
        self.pool.allocate()
        bound = max_cache_tokens(self.compress) if self.policy is not None else None
        self.runner = ModelRunner(self.lm, self.pool, cfg.cuda_graphs, bound)
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.newline_ids: set[int] = set()
        if self.policy is not None and self.compress.divide_method == "newline":
            self.newline_ids = set(newline_token_ids(tokenizer))
        self.last_stats = GenerateStats()
        self.allocator: PageAllocator | None = None  # the last generate() call's

    @property
    def blocks(self) -> PageAllocator | None:
        """The old name of `allocator`."""
        return self.allocator

    # ---- phase control ------------------------------------------------------------------

    def sleep(self) -> None:
        """Free the KV pool (and query ring, and decode graphs) for the training phase."""
        self.runner.release_graphs()
        self.pool.release()

    def wake(self) -> None:
        if not self.pool.allocated:
            self.pool.allocate()
            self.runner.reset_graphs()

    def update_weights(self, model: nn.Module) -> None:
        """Re-bind to the (possibly new) parameter tensors of `model`; nothing is copied.
        Captured decode graphs are dropped (they hold the old tensors' addresses)."""
        self.lm.bind(model)
        self.runner.reset_graphs()

    # ---- generation ---------------------------------------------------------------------

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 progress: bool = False) -> list[SampleOutput]:
        """Sample params.n completions per prompt; outputs are prompt-major."""
        if not self.pool.allocated:
            raise RuntimeError("engine is asleep: call wake() before generate()")
        base_seed = params.seed if params.seed is not None else random.getrandbits(32)
        allocator = self.allocator = PageAllocator(self.pool.num_pages, self.pool.page_size)
        sched = Scheduler(allocator, self.cfg.max_num_seqs, self.cfg.max_prefill_tokens)
        seqs = []
        for p, prompt in enumerate(prompt_token_ids):
            for j in range(params.n):
                index = p * params.n + j
                seed = seed_for(base_seed, params.seed_offset + index)
                seq = Sequence(index, p, j, list(prompt), len(prompt), seed)
                seqs.append(seq)
                if not prompt or len(prompt) >= self.pool.max_model_len:
                    seq.finish_reason = "abort"
                else:
                    sched.add(seq)
        stats = GenerateStats()
        start = time.perf_counter()
        bar = _progress(len(seqs), progress)
        while not sched.done:
            finished = self._step(sched, params, stats)
            if bar is not None and finished:
                bar.update(finished)
        if bar is not None:
            bar.close()
        stats.wall_s = time.perf_counter() - start
        stats.generated_tokens = sum(s.num_generated for s in seqs)
        stats.tokens_per_s = stats.generated_tokens / max(stats.wall_s, 1e-9)
        stats.peak_pages_used = allocator.peak_used
        stats.preemptions = sched.preemptions
        stats.compressions = sum(s.num_compressions for s in seqs)
        stats.evicted_tokens = sum(s.evicted_tokens for s in seqs)
        self.last_stats = stats
        return [s.to_output() for s in seqs]

    def _step(self, sched: Scheduler, params: SamplingParams, stats: GenerateStats) -> int:
        """One engine step; returns how many sequences finished in it."""
        chunks, aborted = sched.schedule_prefill()
        for seq in aborted:
            seq.finish_reason = "abort"
        if chunks:
            self._sync_pages(sched)
            done, tokens, logprobs = self.runner.prefill(chunks, params)
            for seq, n in chunks:
                seq.num_computed += n
                seq.cache_len += n
                seq.peak_cache = max(seq.peak_cache, seq.cache_len)
            for seq in done:
                sched.finish_prefill(seq)
                seq.since_compress = 0
            stats.prefill_tokens += sum(n for _, n in chunks)
        else:
            done = sched.schedule_decode()
            if not done:
                return len(aborted)
            self._sync_pages(sched)
            tokens, logprobs = self.runner.decode(done, params)
            for seq in done:
                seq.num_computed += 1
                seq.since_compress += 1
                seq.cache_len += 1
                seq.peak_cache = max(seq.peak_cache, seq.cache_len)
        stats.steps += 1
        stats.peak_kv_tokens = max(stats.peak_kv_tokens, _cached_tokens(sched))
        finished = self._append(sched, done, tokens, logprobs, params)
        self._compress(sched, [s for s in done if s.finish_reason is None])
        return finished + len(aborted)

    def _append(self, sched: Scheduler, seqs: list[Sequence], tokens: list[int],
                logprobs: list[float], params: SamplingParams) -> int:
        finished = 0
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        max_new, max_len = params.max_new_tokens, self.pool.max_model_len
        for seq, tok, lp in zip(seqs, tokens, logprobs):
            ids = seq.token_ids
            ids.append(tok)
            seq.logprobs.append(lp)
            if tok in stop:
                reason = "stop"
            elif len(ids) - seq.num_prompt >= max_new or len(ids) >= max_len:
                reason = "length"
            else:
                continue
            sched.finish(seq, reason)
            finished += 1
        return finished

    def _compress(self, sched: Scheduler, seqs: list[Sequence]) -> None:
        """Compress every sequence of `seqs` the trigger marks due, in one batched call."""
        if self.policy is None or not seqs:
            return
        budget = self.policy.budget
        seqs = [s for s in seqs if s.cache_len > budget]  # never due at or under budget
        if not seqs:
            return
        lens = torch.tensor([s.cache_len for s in seqs])
        since = torch.tensor([s.since_compress for s in seqs])
        newline = torch.tensor([s.last_token in self.newline_ids for s in seqs])
        due = compress_due(lens, since, newline, self.compress).tolist()
        due = [s for s, d in zip(seqs, due) if d]
        if not due:
            return
        compact(self.pool, self.policy, [s.slot for s in due], [s.cache_len for s in due],
                [s.num_computed for s in due])
        sched.compacted(due, budget)

    def _sync_pages(self, sched: Scheduler) -> None:
        dirty = sched.take_dirty()
        self.pool.set_rows([s.slot for s in dirty], [s.pages for s in dirty])


def _cached_tokens(sched: Scheduler) -> int:
    return sum(s.cache_len for s in sched.running) + sum(s.cache_len for s in sched.waiting)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="generate", unit="seq")
