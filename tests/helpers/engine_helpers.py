"""Helpers for the engine tests: tiny seeded Qwen2 (qkv bias, tied embeddings) and Llama
(llama3 rope scaling, untied) models built in-process, references computed with
transformers itself, and the Tracker that checks compressed attention."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import minisparse.engine.engine as engine_mod
import minisparse.engine.models as models_mod
from minisparse.config.schema import CompressConfig, EngineConfig
from minisparse.engine import LLMEngine

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
EOS = 3


class Tok:
    """The engine only reads eos_token_id and the vocabulary's end-of-turn markers (and
    decodes ids for the newline trigger); this model's vocabulary has no such markers."""
    eos_token_id = EOS

    def get_vocab(self) -> dict[str, int]:
        return {}


def build(arch: str, dtype=torch.float32, device="cpu", **shape) -> torch.nn.Module:
    """shape: overrides of SHAPE (e.g. 6 query heads: the Qwen2.5-1.5B's head counts are
    not powers of two)."""
    torch.manual_seed(0)
    shape = SHAPE | shape
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **shape))
        for layer in model.model.layers:  # non-zero qkv biases so they matter
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    else:
        rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=64)
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, head_dim=16,
                                             rope_parameters=rope, **shape))
    model.generation_config.eos_token_id = None
    return model.to(device=device, dtype=dtype).eval()


def make_engine(model, compress: CompressConfig | None = None, **kw) -> LLMEngine:
    kw.setdefault("kv_cpu_memory_gb", 0.02)
    kw.setdefault("max_num_seqs", 16)
    return LLMEngine(model, Tok(), EngineConfig(**kw), compress, model.device)


def prompts(n: int, lo: int = 3, hi: int = 40, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(4, 128, (k,), generator=g).tolist() for k in lens]


def read_cache(pool, layer: int, row: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries 0..n-1 of a row's cache in one layer, read slot by slot (not the way
    compaction gathers them): K and V, each [H_kv, n, D]."""
    slots = pool.slots(torch.tensor([row]), n)[0]
    return pool.k[layer, slots].transpose(0, 1), pool.v[layer, slots].transpose(0, 1)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def dense_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0,
                   full: bool = False) -> torch.Tensor:
    """log_softmax(logits / T) of `tokens` (or the whole rows when full) in one forward."""
    ids = torch.tensor([prompt + tokens], device=model.device)
    logits = model(ids).logits[0, len(prompt) - 1:-1].float() / (temperature or 1.0)
    lp = torch.log_softmax(logits, -1)
    return lp if full else lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0]


def greedy_matches_transformers(model, engine, prompts: list[list[int]], outs,
                                slack: float) -> tuple[int, list[int]]:
    """Checks greedy engine outputs against transformers on a GPU in bf16: every engine
    token is within `slack` of the argmax of a teacher-forced forward, and where greedy
    transformers differs, the first difference is a near-tie (within slack). Compared up
    to the engine's first end-of-turn token (hf_greedy bans it, the engine may pick it
    under ignore_eos). (identical outputs, first differing step of each other one)."""
    same, first_diff = 0, []
    for p, o in zip(prompts, outs):
        new = len(o.token_ids)
        ref = hf_greedy(model, p, new)
        rows = dense_logprobs(model, p, o.token_ids, full=True)
        chosen = rows.gather(-1, torch.tensor(o.token_ids, device=rows.device)[:, None])[:, 0]
        assert (rows.max(-1).values - chosen).max() <= slack
        end = next((i for i, t in enumerate(o.token_ids) if t in engine.eos_ids), new)
        n = next((i for i, (a, b) in enumerate(zip(o.token_ids[:end], ref)) if a != b), end)
        same += n == end
        if n < end:
            first_diff.append(n)
            top2 = rows[n].topk(2).values
            assert top2[0] - top2[1] <= slack, (n, top2)  # a near-tie, not a bug
    return same, first_diff


class Tracker:
    """Mirrors each (sequence, layer) cache as per-KV-head lists of original positions,
    from the K/V written at each step and the policy's selections at each compaction, and
    checks every decode attention output against softmax(q K_kept^T) V_kept computed
    naively from those positions (max_err, over `checked` (seq, layer, head) cases)."""

    def __init__(self, engine) -> None:
        self.engine, self.kv, self.entries = engine, {}, {}
        self.seqs, self.chunks, self.layer, self.checked, self.max_err = [], None, 0, 0, 0.0
        self.selected: list[torch.Tensor] = []

    def step(self, seqs, chunks=None) -> None:
        self.seqs, self.chunks, self.layer = seqs, chunks, 0

    def attention(self, real, q, k, v, k_cache, v_cache, ctx, scale):
        out = real(q, k, v, k_cache, v_cache, ctx, scale)
        layer, self.layer = self.layer, self.layer + 1
        if self.chunks is not None:
            i = 0
            for seq, n in self.chunks:
                if seq.num_computed == 0:
                    self.entries[seq.seq_id, layer] = [[] for _ in range(k.shape[1])]
                for t in range(n):
                    self._add(seq, layer, seq.num_computed + t, k[i], v[i])
                    i += 1
            return out
        G = q.shape[1] // k.shape[1]
        for b, seq in enumerate(self.seqs):
            self._add(seq, layer, seq.num_computed, k[b], v[b])
            for h, pos in enumerate(self.entries[seq.seq_id, layer]):
                keys = torch.stack([self.kv[seq.seq_id, layer, p][0][h] for p in pos]).float()
                vals = torch.stack([self.kv[seq.seq_id, layer, p][1][h] for p in pos]).float()
                qh = q[b, h * G:(h + 1) * G].float()
                ref = torch.softmax(qh @ keys.T * scale, -1) @ vals
                err = (ref - out[b, h * G:(h + 1) * G].float()).abs().max().item()
                self.max_err = max(self.max_err, err)
                self.checked += 1
        return out

    def _add(self, seq, layer, pos, k, v) -> None:
        self.kv[seq.seq_id, layer, pos] = (k.clone(), v.clone())
        for head in self.entries[seq.seq_id, layer]:
            head.append(pos)

    def compacted(self, rows, protected=None) -> None:
        """protected[i]: leading entries of rows[i] that stay (keep_prompt), before the
        selected ones."""
        by_slot = {s.slot: s for s in self.seqs or [c[0] for c in self.chunks]}
        keep = torch.cat(self.selected)
        self.selected.clear()
        n_layers = self.engine.lm.num_layers
        keep = keep.view(len(rows), n_layers, keep.shape[1], keep.shape[2])
        for i, row in enumerate(rows):
            seq, first = by_slot[row], protected[i] if protected else 0
            for layer in range(n_layers):
                heads = self.entries[seq.seq_id, layer]
                kept = keep[i, layer].tolist()
                self.entries[seq.seq_id, layer] = [head[:first] + [head[j] for j in idx]
                                                   for head, idx in zip(heads, kept)]


def track(engine, monkeypatch) -> Tracker:
    """Route the engine's attention, steps and compactions through a new Tracker."""
    tr = Tracker(engine)
    real_attn, real_compact = models_mod.paged_attention, engine_mod.compact
    real_select = engine.rule.select_batch
    monkeypatch.setattr(models_mod, "paged_attention",
                        lambda *a: tr.attention(real_attn, *a))
    real_attend = models_mod.attend

    def attend(q, k_cache, v_cache, ctx, scale):  # CUDA kernel path: K/V already written
        keys, values = k_cache[ctx.slot_mapping], v_cache[ctx.slot_mapping]
        return tr.attention(lambda q, k, v, kc, vc, c, s: real_attend(q, kc, vc, c, s),
                            q, keys, values, k_cache, v_cache, ctx, scale)

    monkeypatch.setattr(models_mod, "attend", attend)
    real_kernels = models_mod.decode_kernels

    def decode_kernels(h):  # CUDA decode: RoPE and the K/V write inside the attention kernel
        kernels = real_kernels(h)
        if not kernels:
            return kernels

        def rope_decode_attention(qkv, cos, sin, slots, k_cache, v_cache, page_table, rows,
                                  cache_lens, page_size, scale, num_heads, *ring, **kw):
            out = kernels.rope_decode_attention(qkv, cos, sin, slots, k_cache, v_cache,
                                                page_table, rows, cache_lens, page_size, scale,
                                                num_heads, *ring, **kw)
            D = k_cache.shape[-1]
            q = qkv[:, :num_heads * D].view(qkv.shape[0], num_heads, D)
            q = q * cos + models_mod.rotate_half(q) * sin
            return tr.attention(lambda *a: out, q, k_cache[slots], v_cache[slots], k_cache,
                                v_cache, None, scale)

        return SimpleNamespace(rope_decode_attention=rope_decode_attention)

    monkeypatch.setattr(models_mod, "decode_kernels", decode_kernels)
    runner = engine.runner
    real_launch, real_prefill = runner.launch, runner.prefill
    monkeypatch.setattr(runner, "launch",
                        lambda seqs, sp, inputs: (tr.step(seqs), real_launch(seqs, sp, inputs))[1])
    monkeypatch.setattr(runner, "prefill",
                        lambda chunks, sp: (tr.step([], chunks), real_prefill(chunks, sp))[1])
    monkeypatch.setattr(engine.rule, "select_batch",
                        lambda *a, **k: tr.selected.append(real_select(*a, **k)) or tr.selected[-1])

    def compact(pool, policy, rows, lens, next_pos, protected=None):
        # through select_batch, where the tracker sees the selection (the fused scoring
        # kernel is pinned to it by tests/engine/test_triton_scores.py)
        real_compact(pool, policy, rows, lens, next_pos, protected, fused=False)
        tr.compacted(rows, protected)
    monkeypatch.setattr(engine_mod, "compact", compact)
    return tr
