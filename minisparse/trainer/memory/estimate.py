"""Each phase's peak GPU memory, estimated from the model's shape before anything is
loaded: what the memory plan (plan.py) decides from.

One GPU holds three phases in turn (train.py): the rollout (weights + the engine's KV
pool), the log-prob passes (no gradients; the reference model visits) and the update
(forward + backward per micro-batch, then the optimizer step).

Sizes (bytes), for P parameters of b bytes (2 in bf16), N ranks, ZeRO stage Z, a decoder
of L layers, hidden size H, Hq = heads x head_dim, Hkv = KV heads x head_dim, MLP width
I, vocabulary V, and T tokens in the largest micro-batch (a sequence longer than
max_tokens_per_gpu is a micro-batch of its own, so T = max(max_tokens_per_gpu, longest
sequence = data.max_prompt_len + max_response_len)):

* training state: weights bP (Z3: bP/N + 1e9 gathered parameters), fp32 master weights
  4P/N and AdamW moments 8P/N (Z0: moments 2bP, no master). Gradients bP/N (Z0/1: bP),
  a second bP/N while a step's later micro-batches run (DeepSpeed 0.19.8 allocates the
  next partition while the last is held), and DeepSpeed's 5e8-element gradient bucket.
  Optimizer step: + a flat bP/N copy + fp32 gradients 4P/N: 22P on one GPU under ZeRO 2.
* activations saved for the backward, per token and decoder layer (Qwen2/Llama layout:
  the inputs of both norms, both norm outputs, q, k, v and the attention output, gate,
  up and SiLU(gate)*up, the attention's float32 log-sum-exp and the norms' 1/rms):
    Liger kernels:  a = b(4H + 2Hq + 2Hkv + 3I) + 4(heads + 2)
    PyTorch ops:    a = b(4H + 2Hq + 2Hkv + 4I) + 8H + 4(heads + 2)
  (PyTorch's RMSNorm keeps a float32 copy of its input, its SiLU the gate), so T·L·a
  without checkpointing, T·L·b·H + T·a with it on every layer (each layer's input, one
  layer recomputed), and T·(c·b·H + (L - c)·a) with it on the first c layers only (their
  recompute comes after the other layers' backward has freed more than it needs).
  Qwen2.5-3B: a = 91,720 bytes (3.3 MB a token over 36 layers).
* the update's peak is the larger of two moments: the start of the backward (all
  activations + the LM head's backward: float32 and bf16 weight gradients 4VH + bVH and
  one chunk's logits b·chunk·V, which the CUDA kernels turn into their gradient in
  place; the CPU path's float32 copies are not planned for) and DeepSpeed's first
  gradient-bucket flush, once 5e8 gradient elements are ready (f = that share of the
  layers is done, the last ones, their activations freed; an untied LM head's gradient
  comes first and counts toward the 5e8): activations less those + the new gradient
  partition + the bucket (two on several GPUs, where DeepSpeed overlaps the reduction)
  + the head's bVH gradient + one layer's backward work T·b(I + 2H).
* log-prob passes: state (+ bP while the reference model visits) + one layer's forward
  work T·b(3H + 3I) + the LM head's (its input bTH and one chunk's logits b·chunk·V;
  unfused logits T·V·(b + 8)). A [T, T] mask more under model.attention=sdpa.
* rollout: the weights the engine samples with + the KV pool (engine.kv_memory_gb, else
  engine.kv_memory_fraction of what is free) + sampling's float32 logits, probabilities
  and sort over max_num_seqs rows (16·V bytes a row); + the training state (master
  weights, moments, gradient partition) where the plan keeps it on the GPU, which it does
  when the pool beside it still holds every sequence of a rollout at its largest cache.

Under optimizer_offload=cpu_adam (DeepSpeed ZeRO-Offload, ZeRO 1 or 2) master weights,
moments and fp32 gradients live on the CPU and the step runs there: the GPU keeps the
weights bP and DeepSpeed's gradient staging buffer b·Pmax (Pmax: the largest parameter,
the embedding V·H). ZeRO 1 accumulates the bf16 gradients on the GPU (bP) and copies them
to the CPU once, at the step (through its bucket; each parameter's float32 copy 4·Pmax
on the way); ZeRO 2 keeps only its gradient bucket(s) and copies the accumulated
gradients GPU -> CPU -> GPU after every micro-batch's backward (4P bytes over PCIe each),
its step restoring one parameter's gradient at a time (b·Pmax + 4·Pmax). The
host holds 20P/N (fp32 master weights 4, moments 8, fp32 gradients 4, a bf16 copy of the
weights 2 and the accumulated bf16 gradients 2; all but the moments pinned), + bP for a
reference model (it lives on the CPU).

LoRA (model.lora): the optimizer state, gradients and buckets are the adapters' (Pt
parameters, rank x (in + out) per adapted linear layer) in place of P's; the adapters add
bPt to the weights, no LM-head gradient is made (the head is frozen), no reference copy
visits (the reference pass is the policy with its adapters off), and the rollout holds
the merged copy of the adapted weights (b a weight; freed for the training phases).

How close the estimates came to measured peaks: docs/memory.md, "Memory plan".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisparse.compression.trigger import max_cache_tokens
from minisparse.config.schema import Config, LoraConfig
from minisparse.trainer.train_engine import cpu_adam_of, overlaps_reduction, zero_stage_of
from minisparse.models.loading import attention_heads

GIB = 1024**3
BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size (gradient elements)
LIVE_PARAMETERS = 1_000_000_000  # ZeRO 3's stage3_max_live_parameters


@dataclass(frozen=True)
class ModelShape:
    """What the estimates read from a decoder-only HF model (Qwen2 / Llama layout)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: int
    tied: bool = True  # the LM head shares the input embedding's weight

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer's linear layers."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * self.hidden * q + 2 * self.hidden * kv + 3 * self.hidden * self.intermediate


def shape_of(config) -> ModelShape:
    """The shape of an HF model config; parameters are counted on the meta device (tied
    embeddings once), without memory, in about a second for a 7B model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    heads, kv_heads, head_dim = attention_heads(config)
    return ModelShape(
        hidden=config.hidden_size, layers=config.num_hidden_layers, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, intermediate=config.intermediate_size,
        vocab=config.vocab_size,
        params=sum(p.numel() for p in model.parameters()),
        tied=bool(getattr(config, "tie_word_embeddings", True)))


@dataclass(frozen=True)
class Setup:
    """What a run puts on each GPU, as the estimates need it."""

    shape: ModelShape
    dtype_bytes: int
    world: int
    zero_stage: int
    longest: int  # tokens of the longest sequence (prompt + response)
    max_tokens: int  # max_tokens_per_gpu
    logprob_tokens: int  # the log-prob passes' budget before the plan fits it (logprob_budget)
    logprob_chunk: int
    liger: bool
    sdpa: bool
    reference: bool  # a reference model visits for its log-prob pass
    kv_memory: int  # engine.kv_memory_gb in bytes; 0: a fraction of the free memory
    kv_fraction: float
    max_num_seqs: int
    rollout_sequences: int = 0  # sequences a rollout decodes at once, at most
    rollout_cache: int = 0  # KV tokens one of them holds at most (whole pages)
    trainable: int = 0  # LoRA: the adapters' parameters, the only ones trained; 0: all
    merged: int = 0  # LoRA: parameters of the adapted weights, merged for the rollout
    cpu_adam: bool = False  # the optimizer's state and step on the CPU (ZeRO-Offload)

    @property
    def trained(self) -> int:
        """Parameters the optimizer holds state for: the adapters under LoRA, else all."""
        return self.trainable or self.shape.params

    @property
    def worst_tokens(self) -> int:
        """Tokens of the largest micro-batch at max_tokens_per_gpu: a longer sequence is
        a micro-batch of its own."""
        return max(self.max_tokens, self.longest)


def rollout_cache_tokens(cfg: Config) -> int:
    """KV tokens one rollout sequence holds at most, in whole pages: prompt + response
    dense; compressed, the trigger's bound (a longer prompt only until its first check)."""
    longest = cfg.data.max_prompt_len + cfg.max_response_len
    bound = max_cache_tokens(cfg.compress, cfg.data.max_prompt_len)
    tokens = longest if bound is None else min(longest, max(bound, cfg.data.max_prompt_len))
    page = cfg.engine.page_size
    return (-(-tokens // page) + 1) * page  # + the page the next token opens


# The auto log-prob budget. A micro-batch's forward costs the 1.5B an estimated ~30 ms
# of host work (kernel launches) whatever its size: 8,192-token micro-batches of
# 1,700-token sequences ran its log-prob passes at 53-54% MFU on an H200, those of one
# 4,200-token sequence (the paper's lengths at 8,192) at 36% (docs/benchmarks.md,
# "Log-prob micro-batches").
AUTO_LOGPROB_TOKENS = 16384


def logprob_budget(cfg: Config, planned: bool = True) -> int:
    """logprob_max_tokens_per_gpu, or auto's max(max_tokens_per_gpu, AUTO_LOGPROB_TOKENS)
    (without a memory plan, which would check the room: max_tokens_per_gpu); the plan
    may give the passes less."""
    auto = AUTO_LOGPROB_TOKENS if planned else 0
    return cfg.logprob_max_tokens_per_gpu or max(cfg.max_tokens_per_gpu, auto)


def lora_sizes(shape: ModelShape, lora: LoraConfig) -> tuple[int, int]:
    """(adapter parameters, parameters of the weights they adapt) of model.lora on a
    decoder of this shape: rank x (in + out) and in x out per adapted linear layer."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    h, i = shape.hidden, shape.intermediate
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    adapted = [dims[name] for name in set(lora.target_modules)]
    return (shape.layers * sum(lora.rank * (a + b) for a, b in adapted),
            shape.layers * sum(a * b for a, b in adapted))


def setup_of(cfg: Config, shape: ModelShape, world: int, liger: bool, reference: bool) -> Setup:
    """What cfg puts on each of `world` GPUs for a model of this shape; liger: Liger's
    kernels run the training passes; reference: the loss needs a reference policy's
    log-probs (a copy of the policy visits for them, but under LoRA, whose reference is the
    base with its adapters off)."""
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[cfg.model.dtype]
    per_rank = cfg.rollout_batch_size * cfg.n_samples_per_prompt // world
    lora = cfg.model.lora.enabled
    trainable, merged = lora_sizes(shape, cfg.model.lora) if lora else (0, 0)
    return Setup(
        shape=shape, dtype_bytes=dtype_bytes, world=world, zero_stage=zero_stage_of(cfg),
        longest=cfg.data.max_prompt_len + cfg.max_response_len,
        max_tokens=cfg.max_tokens_per_gpu, logprob_tokens=logprob_budget(cfg),
        logprob_chunk=cfg.model.logprob_chunk,
        liger=liger, sdpa=cfg.model.attention == "sdpa",
        reference=reference and not lora,
        trainable=trainable, merged=merged,
        kv_memory=int(cfg.engine.kv_memory_gb * GIB), kv_fraction=cfg.engine.kv_memory_fraction,
        max_num_seqs=cfg.engine.max_num_seqs,
        rollout_sequences=min(cfg.engine.max_num_seqs, per_rank),
        rollout_cache=rollout_cache_tokens(cfg), cpu_adam=cpu_adam_of(cfg))


# ------------------------------------------------------------------------ the estimates


def weights(s: Setup) -> int:
    """The policy's weights on one GPU during the training phases."""
    p, b = s.shape.params, s.dtype_bytes
    if s.zero_stage == 3:
        return b * p // s.world + b * min(p, LIVE_PARAMETERS)
    return b * (p + s.trainable)  # (LoRA: the adapters beside the base)


def largest_parameter(s: Setup) -> int:
    """Elements of the largest parameter: the embedding (V·H) in these decoders."""
    m = s.shape
    return max(m.vocab * m.hidden, m.intermediate * m.hidden)


def optimizer_state(s: Setup, adam: bool = True) -> int:
    """fp32 master weights and AdamW moments (moments only once a step has made them) on
    the GPU; under CPU Adam none, only DeepSpeed's gradient staging buffer (b·Pmax)."""
    p = s.trained
    if s.cpu_adam:
        return s.dtype_bytes * largest_parameter(s)
    if s.zero_stage == 0:
        return 2 * s.dtype_bytes * p if adam else 0
    return (4 * p + (8 * p if adam else 0)) // s.world


def gradients(s: Setup) -> int:
    """The bf16 gradients on the GPU: every one under ZeRO 0/1 (in .grad), the partition
    under ZeRO 2, none under ZeRO 2 with CPU Adam (copied to the CPU per bucket)."""
    p, b = s.trained, s.dtype_bytes
    if s.cpu_adam and s.zero_stage >= 2:
        return 0
    return b * p // s.world if s.zero_stage >= 2 else b * p


def per_token_layer(s: Setup) -> int:
    """Activation bytes one token leaves in one decoder layer for the backward."""
    m, b = s.shape, s.dtype_bytes
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    common = b * (4 * m.hidden + 2 * q + 2 * kv) + 4 * (m.heads + 2)
    if s.liger:
        return common + 3 * b * m.intermediate
    return common + 4 * b * m.intermediate + 8 * m.hidden


def all_or_none(s: Setup, checkpointing: bool) -> int:
    """Layers under gradient checkpointing when it is on for every layer or for none."""
    return s.shape.layers if checkpointing else 0


def activations(s: Setup, tokens: int, checkpointed: int) -> int:
    """Saved for the backward with the first `checkpointed` decoder layers checkpointed."""
    m = s.shape
    mask = tokens * tokens if s.sdpa else 0
    full = max(m.layers - checkpointed, 1 if checkpointed else 0)  # (one recomputed layer)
    return tokens * (checkpointed * s.dtype_bytes * m.hidden + full * per_token_layer(s)) + mask


def _fused(s: Setup) -> bool:
    """The LM head runs in chunks (not under ZeRO 3, whose weight is partitioned)."""
    return s.logprob_chunk > 0 and s.zero_stage != 3


def head_backward(s: Setup, tokens: int) -> int:
    """The LM head's saved hidden states and its backward's working set."""
    m, b = s.shape, s.dtype_bytes
    vh = 0 if s.trainable else m.vocab * m.hidden  # LoRA: a frozen head, no weight gradient
    if _fused(s):
        chunk = min(s.logprob_chunk, tokens)
        return b * tokens * m.hidden + (4 + b) * vh + b * chunk * m.vocab
    return tokens * m.vocab * (12 + b) + b * vh


def first_flush_share(s: Setup) -> float:
    """Share of the layers whose backward is done when DeepSpeed's gradient bucket first
    fills: their activations are freed by then. An untied LM head's gradient is the
    backward's first and joins that bucket (Qwen2.5-7B's 545M elements fill it alone, so
    no layer's activations are freed yet); a tied one's comes last, with the embedding's."""
    if s.trainable:  # LoRA: the adapters' gradients, spread over the layers (head frozen)
        return min(1.0, BUCKET / s.trainable)
    head = 0 if s.shape.tied else s.shape.vocab * s.shape.hidden
    return max(0.0, min(1.0, (BUCKET - head) / s.shape.layer_params / s.shape.layers))


def bucket_bytes(s: Setup) -> int:
    """One of DeepSpeed's gradient buckets: reduce_bucket_size elements, or every gradient
    where the model has fewer."""
    return s.dtype_bytes * min(BUCKET, s.trained)


def gradient_buckets(s: Setup) -> int:
    """DeepSpeed's gradient buckets (reduce_bucket_size elements each) at ZeRO 2: two
    where it overlaps the reduction with the backward (several GPUs), else one."""
    return 2 if s.zero_stage == 2 and overlaps_reduction(True, s.world, s.zero_stage) else 1


def reduction_bucket(s: Setup) -> int:
    """ZeRO 1's gradient bucket: DeepSpeed's gradient hooks make it at the first backward
    (contiguous_gradients), and the step's one reduction runs through it; without ZeRO
    there is none. ZeRO 2 and 3 count theirs where they flush (gradient_buckets)."""
    return bucket_bytes(s) if s.zero_stage == 1 else 0


def freed_at_first_flush(s: Setup, tokens: int, checkpointed: int) -> int:
    """Activations the backward has freed when the gradient bucket first fills: the last
    layers' (the backward's first), which are the ones not checkpointed."""
    done = first_flush_share(s) * s.shape.layers
    full = s.shape.layers - checkpointed
    kept = s.dtype_bytes * s.shape.hidden  # what a checkpointed layer holds a token
    return int(tokens * (min(done, full) * per_token_layer(s) + max(0.0, done - full) * kept))


def backward_peak(s: Setup, tokens: int, checkpointed: int, offload: bool,
                  adam: bool = True, accumulating: bool = True) -> int:
    """Peak of one micro-batch's forward + backward with `checkpointed` layers under
    gradient checkpointing. accumulating: an earlier micro-batch of the same optimizer step
    left its gradients."""
    m, b = s.shape, s.dtype_bytes
    state = weights(s) + (0 if offload else optimizer_state(s, adam))
    acts = activations(s, tokens, checkpointed)
    grads = gradients(s)
    start = acts + head_backward(s, tokens)
    if s.zero_stage < 2:  # gradients accumulate in place, in the parameters' .grad
        return state + grads + start + reduction_bucket(s)
    head_grad = 0 if s.trainable else b * m.vocab * m.hidden  # (LoRA: the head is frozen)
    flush = (acts - freed_at_first_flush(s, tokens, checkpointed) + grads
             + gradient_buckets(s) * bucket_bytes(s) + head_grad
             + tokens * b * (m.intermediate + 2 * m.hidden))
    return state + (grads if accumulating else 0) + max(start, flush)


def step_peak(s: Setup, adam: bool = True) -> int:
    """The optimizer step: state, gradients, their flat copy and float32 version. The
    first step makes the AdamW moments once the flat copy is gone (20P rather than 22P
    on one GPU under ZeRO 2). P: the trained parameters (LoRA: the adapters')."""
    p, b = s.trained, s.dtype_bytes
    if s.cpu_adam:  # ZeRO 1: the gradients and the bucket they are reduced through; then
        # one parameter's gradient on the GPU at a time (ZeRO 2: restored), its fp32 copy
        return (weights(s) + optimizer_state(s) + gradients(s) + reduction_bucket(s)
                + (b + 4) * largest_parameter(s))
    if s.zero_stage == 0:
        return weights(s) + optimizer_state(s) + gradients(s)
    copy = b * p // s.world if adam else 0
    return weights(s) + optimizer_state(s) + gradients(s) + copy + 4 * p // s.world


def update_peak(s: Setup, tokens: int, checkpointed: int, offload: bool,
                adam: bool = True, accumulating: bool = True) -> int:
    return max(backward_peak(s, tokens, checkpointed, offload, adam, accumulating),
               step_peak(s))


def logprob_peak(s: Setup, tokens: int, adam: bool = True) -> int:
    """Old and reference log-prob passes (no gradients) over a micro-batch of tokens."""
    m, b = s.shape, s.dtype_bytes
    work = tokens * (b * (3 * m.hidden + 3 * m.intermediate)
                     + (0 if s.liger else b * m.intermediate + 8 * m.hidden))
    if _fused(s):
        head = b * tokens * m.hidden + b * min(s.logprob_chunk, tokens) * m.vocab
    else:
        head = tokens * m.vocab * (b + 8)
    mask = tokens * tokens if s.sdpa else 0
    reference = b * m.params if s.reference else 0
    return weights(s) + optimizer_state(s, adam) + reference + work + head + mask


def host_memory(s: Setup) -> int:
    """Host memory one rank's CPU Adam holds (20P/N, module docstring) + the reference
    model's bP on the CPU; 0 without CPU Adam."""
    if not s.cpu_adam:
        return 0
    p = s.shape.params
    return 20 * s.trained // s.world + (s.dtype_bytes * p if s.reference else 0)


def training_state(s: Setup) -> int:
    """What the swap to a rollout moves off the GPU under ZeRO 1-3: fp32 master weights,
    AdamW moments and the gradient partition (without ZeRO nothing moves). Under CPU
    Adam: its staging buffer, which stays (its step leaves no gradient on the GPU)."""
    if s.cpu_adam:
        return optimizer_state(s)
    return optimizer_state(s) + gradients(s) if s.zero_stage else 0


def rollout_resident(s: Setup, keep_state: bool = False) -> int:
    """What stays on the GPU beside the KV pool while the engine samples: the weights
    (ZeRO 3 gathers them whole; without ZeRO the optimizer state stays too), and the
    training state where it is kept there."""
    b, p = s.dtype_bytes, s.shape.params + s.trainable + s.merged  # LoRA: adapters, merged
    kept = training_state(s) if keep_state else 0
    if s.zero_stage == 3:
        return b * p + b * p // s.world + kept
    return b * p + (optimizer_state(s) if s.zero_stage == 0 else kept)


def kv_pool(s: Setup, capacity: int, keep_state: bool = False) -> int:
    if s.kv_memory:
        return s.kv_memory
    return max(0, int(s.kv_fraction * (capacity - rollout_resident(s, keep_state))))


def rollout_peak(s: Setup, capacity: int, keep_state: bool = False) -> int:
    return (rollout_resident(s, keep_state) + kv_pool(s, capacity, keep_state)
            + 16 * s.max_num_seqs * s.shape.vocab)


def kv_tokens(s: Setup, capacity: int, keep_state: bool = False) -> int:
    """Tokens the KV pool holds (K and V of every layer)."""
    m = s.shape
    return (kv_pool(s, capacity, keep_state)
            // (2 * m.layers * m.kv_heads * m.head_dim * s.dtype_bytes))


def rollout_kv_need(s: Setup) -> int:
    """KV tokens a rollout's sequences hold at most, all at once."""
    return s.rollout_sequences * s.rollout_cache


# ---------------------------------------------------------------------------- on a CPU
# A CPU run's process holds, besides what the phases' estimates count: the libraries
# once imported (torch, transformers, DeepSpeed, the tokenizer: 0.6 GiB measured with
# the tiny model) and what the C allocator keeps of freed activations of varying sizes
# (glibc returns little of it): the estimates + 20% gave SmolLM2-135M's 4.1 GiB, where
# 4.1-4.3 GiB were measured (docs/memory.md, "On a CPU").
CPU_LIBRARIES = int(0.6 * GIB)
CPU_ALLOCATOR = 0.2


def cpu_peak(s: Setup, checkpointed: int, pool: int) -> tuple[int, str]:
    """(peak resident bytes, the phase it falls in) of a run on a CPU, where one memory
    holds every phase: the training state stays through rollouts, and the engine's KV
    pool (`pool` bytes) is held during rollouts only; `checkpointed` decoder layers
    under gradient checkpointing."""
    tokens = s.worst_tokens
    rollout = (rollout_resident(s) + (0 if s.zero_stage == 0 else optimizer_state(s))
               + pool + 16 * s.max_num_seqs * s.shape.vocab)
    phases = {"rollout": rollout,
              "log-prob passes": logprob_peak(s, max(s.logprob_tokens, s.longest)),
              "update": update_peak(s, tokens, checkpointed, offload=False)}
    name = max(phases, key=phases.get)
    return CPU_LIBRARIES + int(phases[name] * (1 + CPU_ALLOCATOR)), name
