"""LLMEngine: the rollout engine. Owns the KV pool, scheduler and model runner, and runs
the step loop, schedule -> run -> scheduler.postprocess: prefill (chunked) whenever waiting
sequences fit, else one decode step for every running sequence; after the forward, the
caches that the trigger marks due are compacted, and postprocess appends the sampled
tokens, finishes sequences and takes back the pages compaction freed.
"""
from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from minisparse.compression import (build_rule, compress_due, evictable_len, max_cache_tokens,
                                   newline_token_ids)
from minisparse.engine.page_allocator import PageAllocator
from minisparse.engine.progress import GenerateProgress
from minisparse.engine.compaction import compact, warm_up
from minisparse.config.schema import CompressConfig, EngineConfig
from minisparse.engine.config import SamplingParams
from minisparse.engine.kv_pool import KVPool
from minisparse.engine.layers.sampler import seed_for
from minisparse.engine.model_runner import DecodeLaunch, ModelRunner
from minisparse.engine.models import CausalLM
from minisparse.engine.scheduler import Scheduler
from minisparse.engine.timing import PhaseTimer
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
        self.lm = CausalLM(model, fuse=self.device.type == "cuda",  # fused qkv, gate/up copy
                           fused_kernels=cfg.fused_kernels)
        self.rule = build_rule(self.compress)  # None when dense
        # The query ring holds the last `window` queries for the rules that score with them.
        ring = self.rule.window if self.rule and self.rule.uses_queries else 0
        self.pool = KVPool(self.lm, cfg, ring, self.device)
        self.pool.allocate()
        bound = max_cache_tokens(self.compress) if self.rule is not None else None
        self.runner = ModelRunner(self.lm, self.pool, cfg.cuda_graphs, bound)
        if self.rule is not None and self.device.type == "cuda":
            warm_up(self.pool, self.rule)  # compaction's kernels built before any rollout
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.newline_ids: set[int] = set()
        if self.rule is not None and self.compress.divide_method == "newline":
            self.newline_ids = set(newline_token_ids(tokenizer))
        self.last_stats = GenerateStats()
        self.allocator: PageAllocator | None = None  # the last generate() call's
        self.timer = PhaseTimer(self.device)
        self.held: list[Sequence] = []

    # ---- phase control ------------------------------------------------------------------

    def sleep(self) -> None:
        """Free the KV pool (and query ring, and decode graphs) for the training phase."""
        self.runner.release_graphs()
        self.lm.release_fused()
        self.pool.release()

    def wake(self) -> None:
        if not self.pool.allocated:
            if self.lm.fuse:  # before the pool, which takes a share of what is left
                self.lm.fuse_weights()
            self.pool.allocate()
            self.runner.reset_graphs()

    @contextmanager
    def dense(self) -> Iterator[None]:
        """Generate with a dense cache inside (a compressed run's evaluation, scored like a
        dense run's): no rule, decode graphs for uncompressed lengths."""
        if self.rule is None:
            yield
            return
        saved = self.rule, self.runner.graph_max_len
        self.rule, self.runner.graph_max_len = None, None
        self.runner.reset_graphs()
        try:
            yield
        finally:
            self.rule, self.runner.graph_max_len = saved
            self.runner.reset_graphs()

    def update_weights(self, model: nn.Module) -> None:
        """Re-bind to the (possibly new) parameter tensors of `model`; only the fused
        qkv / gate-up copy (CUDA) is rebuilt. Captured decode graphs are dropped (they hold
        the old tensors' addresses)."""
        self.lm.bind(model)
        self.runner.reset_graphs()

    # ---- generation ---------------------------------------------------------------------

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 progress: bool = False) -> list[SampleOutput]:
        """Sample params.n completions per prompt; outputs are prompt-major."""
        if not self.pool.allocated:
            raise RuntimeError("engine is asleep: call wake() before generate()")
        allocator = self.allocator = PageAllocator(self.pool.num_pages, self.pool.page_size)
        sched = Scheduler(allocator, self.cfg.max_num_seqs, self.cfg.max_prefill_tokens,
                          self._share_mode(), self.pool.window,
                          self.rule.budget if self.rule is not None else 0,
                          self.compress.keep_prompt, self._cache_bound())
        seqs = self._sequences(prompt_token_ids, params)
        for seq in seqs:
            if seq.finish_reason is None:
                sched.add(seq)
        stats = GenerateStats()
        self.timer = PhaseTimer(self.device)
        self.held = []  # long prompts kept whole for their siblings to copy (_compress)
        start = time.perf_counter()
        shown = GenerateProgress(len(seqs)) if progress else None
        while not sched.done:
            self._step(sched, params, stats)
            if shown is not None and shown.due():
                shown.update(sched.num_finished, sum(s.num_generated for s in seqs))
        if shown is not None:
            shown.close()
        stats.wall_s = time.perf_counter() - start
        self.last_stats = _totals(stats, self.timer, sched, seqs,
                                  self.lm.runs_kernels(self.device))
        return [s.to_output() for s in seqs]

    def _sequences(self, prompt_token_ids: list[list[int]],
                   params: SamplingParams) -> list[Sequence]:
        """params.n sequences per prompt, each with its own seed; those whose prompt is
        empty or fills the context are aborted at once."""
        base_seed = params.seed if params.seed is not None else random.getrandbits(32)
        stop = frozenset(params.stop_token_ids) | frozenset(
            () if params.ignore_eos else self.eos_ids)
        seqs = []
        for p, prompt in enumerate(prompt_token_ids):
            max_tokens = min(len(prompt) + params.max_new_tokens, self.pool.max_model_len)
            for j in range(params.n):
                index = p * params.n + j
                seq = Sequence(index, p, j, list(prompt), len(prompt),
                               seed_for(base_seed, params.seed_offset + index), stop, max_tokens)
                if not prompt or len(prompt) >= self.pool.max_model_len:
                    seq.finish_reason = "abort"
                seqs.append(seq)
        return seqs

    def _cache_bound(self):
        """Prompt length -> the most entries a compressed cache holds (the scheduler's
        admission bound); None when dense."""
        if self.rule is None:
            return None
        compress = self.compress
        return lambda prompt_len: max_cache_tokens(compress, prompt_len)

    def _share_mode(self) -> str:
        """How the samples of a prompt share its prefill (Scheduler): the same pages when
        dense or under keep_prompt (compaction writes only past the prompt), a copy when
        compaction will rewrite them."""
        if not self.cfg.share_prompt_cache:
            return "none"
        return "copy" if self.rule is not None and not self.compress.keep_prompt else "pages"

    def _step(self, sched: Scheduler, params: SamplingParams, stats: GenerateStats) -> None:
        """One prefill step when an admission is due and waiting sequences fit (schedule
        -> run -> postprocess), else a run of decode steps (_decode). The scheduler
        finishes a sequence that can never fit as "abort" itself."""
        chunks = sched.schedule_prefill() if sched.admission_due() else []
        if not chunks:
            self._decode(sched, params, stats)
            return
        self._sync_pages(sched)
        with self.timer.region("prefill"):
            self.pool.copy_pages(sched.take_copies())
            seqs, tokens, logprobs = self.runner.prefill(chunks, params)
        sched.advance(chunks)
        stats.prefill_tokens += sum(n for _, n in chunks)
        stats.steps += 1
        compacted = self._compress(seqs, tokens, stats, step=0, sched=sched)
        sched.postprocess(seqs, tokens, logprobs, [s.cache_len for s in seqs], compacted)

    def _decode(self, sched: Scheduler, params: SamplingParams, stats: GenerateStats) -> None:
        """Decode steps for every running sequence. With cfg.overlap_decode, step N + 1 is
        launched (inputs built on the device from step N's tokens) before step N's tokens
        are read, so the host's bookkeeping of step N runs while the device computes N + 1,
        for as long as _launch_next finds the next step predictable. A sequence that stops
        at step N has one wasted row in N + 1, whose token is dropped. Caches due after
        step N are compacted by _launch_next, before N + 1; after the last step of a run,
        by _compress once its tokens are read."""
        held, self.held = [s for s in self.held if s.finish_reason is None], []
        if held:  # no sibling is admitted now: compacted before any decode step
            self._compact(held, stats, sched)
        seqs = sched.schedule_decode()
        if not seqs:
            return
        self._sync_pages(sched)
        launch = self._launch(sched, seqs, params, self.runner.step_inputs(seqs))
        while launch is not None:
            step = stats.decode_steps + 1  # the trigger's count once `launch` is collected
            nxt, ahead = (self._launch_next(sched, launch, params, step, stats)
                          if self.cfg.overlap_decode else (None, []))
            tokens, logprobs = self.runner.collect(launch)
            _count_decode(launch, stats)
            compacted = self._compress(launch.seqs, tokens, stats, step) if nxt is None else []
            sched.postprocess(launch.seqs, tokens, logprobs, launch.cache_lens, compacted,
                              ahead)
            launch = nxt

    def _launch(self, sched: Scheduler, seqs: list[Sequence], params: SamplingParams,
                inputs: torch.Tensor) -> DecodeLaunch:
        """Queue a decode step; its cache entries count from now (Scheduler.advance)."""
        with self.timer.region("decode"):
            launch = self.runner.launch(seqs, params, inputs)
        sched.advance([(seq, 1) for seq in seqs])
        return launch

    def _launch_next(self, sched: Scheduler, launch: DecodeLaunch, params: SamplingParams,
                     step: int, stats: GenerateStats
                     ) -> tuple[DecodeLaunch | None, list[tuple[Sequence, int]]]:
        """Launch the step after `launch` before its tokens are read, when nothing about it
        depends on them: no admission is due (Scheduler.admission_due), the trigger does
        not read tokens, the pool has every page it needs without preempting. Sequences
        that will finish by length at `launch` are left out; those that stop on a sampled
        token are not known yet and run once more. Caches that fall due after `launch` are
        compacted first, queued behind it: the host launches the event while the device
        runs the step, and the decode loop goes on. Returns the next launch (None when it
        cannot be predicted) and the (sequence, entries evicted) of that event, for
        postprocess: a sequence that stops at `launch` was compacted after its last token."""
        tokens_decide = (self.rule is not None
                         and self.compress.divide_method != "step_length")
        if tokens_decide or sched.admission_due():
            return None, []
        keep = [i for i, s in enumerate(launch.seqs)
                if s.finish_reason is None and not s.at_length(1)]
        if not keep:
            return None, []
        seqs = [launch.seqs[i] for i in keep]
        due = self._due(seqs, None, step)
        ahead = list(zip(due, self._compact(due, stats, sched))) if due else []
        if not sched.reserve_next(seqs):
            return None, ahead
        self._sync_pages(sched)
        same = len(keep) == len(launch.seqs)
        lens = [s.cache_len for s in seqs] if ahead else None  # compaction moved some
        inputs = self.runner.next_inputs(launch, None if same else keep, lens)
        return self._launch(sched, seqs, params, inputs), ahead

    def _compress(self, seqs: list[Sequence], tokens: list[int], stats: GenerateStats,
                  step: int, sched: Scheduler | None = None) -> list[Sequence]:
        """Compact, in one batched call, the caches of the sequences of `seqs` that go on
        after sampling `tokens` and that the trigger marks due; returns them (the scheduler's
        postprocess takes back their pages past the budget). After a prefill (sched given),
        a prompt longer than the budget whose siblings wait to copy it is held whole
        (self.held) and compacted with a later prefill's due caches, or before the next
        decode step: the samples of a long prompt then prefill it once, not once each."""
        if self.rule is None:
            return []
        going = [(s, t) for s, t in zip(seqs, tokens)
                 if s.finish_reason is None and s.stop_reason(t) is None]
        due = self._due([s for s, _ in going], [t in self.newline_ids for _, t in going], step)
        if sched is not None:
            due += [s for s in self.held if s.finish_reason is None]
            wanted = [sched.prompt_wanted(s) for s in due]
            self.held = [s for s, w in zip(due, wanted) if w]
            due = [s for s, w in zip(due, wanted) if not w]
        if due:
            self._compact(due, stats)
        return due

    def _compact(self, seqs: list[Sequence], stats: GenerateStats,
                 sched: Scheduler | None = None) -> list[int]:
        """One compaction event over seqs' caches; with sched, their pages past the budget
        go back at once (Scheduler.compacted), and the entries each evicted are returned."""
        protected = None
        if self.compress.keep_prompt:
            protected = [s.num_prompt for s in seqs]
        with self.timer.region("compress"):
            compact(self.pool, self.rule, [s.slot for s in seqs], [s.cache_len for s in seqs],
                    [s.num_computed for s in seqs], protected)
        stats.compress_events += 1
        return sched.compacted(seqs) if sched is not None else []

    def _due(self, seqs: list[Sequence], newline: list[bool] | None,
             step: int) -> list[Sequence]:
        """The sequences of `seqs` the trigger marks due after decode step `step` (0: after
        a prefill; newline: whether the token each one just sampled holds a newline; None:
        none does)."""
        if self.rule is None:
            return []
        budget, cfg = self.rule.budget, self.compress
        lens = [evictable_len(cfg, s.cache_len, s.num_prompt) for s in seqs]
        over = [i for i, n in enumerate(lens) if n > budget]  # never due under
        if not over:
            return []
        lens = torch.tensor([lens[i] for i in over])
        nl = torch.tensor([bool(newline and newline[i]) for i in over])
        due = compress_due(lens, step, nl, self.compress).tolist()
        return [seqs[i] for i, d in zip(over, due) if d]

    def _sync_pages(self, sched: Scheduler) -> None:
        """Write the pages the scheduler added since the last sync into the device page
        table: only the new tail of each row (a dense 4k-token sequence has ~250 pages, and
        every one of 256 sequences gains a page every page_size steps)."""
        dirty = sched.take_dirty()
        self.pool.set_rows([s.slot for s in dirty], [s.pages for s in dirty],
                           [s.synced_pages for s in dirty])
        for seq in dirty:
            seq.synced_pages = len(seq.pages)


def _count_decode(launch: DecodeLaunch, stats: GenerateStats) -> None:
    """A decode step's counts, over the rows whose tokens are kept."""
    lens = [n for s, n in zip(launch.seqs, launch.cache_lens) if s.finish_reason is None]
    stats.steps += 1
    stats.decode_steps += 1
    stats.graph_steps += launch.graph
    stats.decode_tokens += len(lens)
    stats.decode_kv_tokens += sum(lens)


def _totals(stats: GenerateStats, timer: PhaseTimer, sched: Scheduler,
            seqs: list[Sequence], fused_kernels: bool) -> GenerateStats:
    """stats (wall_s set, step counts kept) completed with the call's totals."""
    phases = timer.seconds()
    stats.prefill_s, stats.decode_s, stats.compress_s = (
        phases.get(k, 0.0) for k in ("prefill", "decode", "compress"))
    stats.generated_tokens = sum(s.num_generated for s in seqs)
    stats.tokens_per_s = stats.generated_tokens / max(stats.wall_s, 1e-9)
    stats.peak_pages_used = sched.allocator.peak_used
    stats.peak_kv_tokens = sched.peak_cached_tokens
    stats.preemptions = sched.preemptions
    stats.compressions = sum(s.num_compressions for s in seqs)
    stats.shared_prompt_tokens = sched.shared_tokens
    stats.evicted_tokens = sum(s.evicted_tokens for s in seqs)
    stats.fused_kernels = fused_kernels
    return stats
