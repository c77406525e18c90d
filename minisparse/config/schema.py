"""The run configuration: one dataclass tree that YAML files, `--set` overrides and every
module share, so a key means the same thing in train.py, eval.py and the engine.

Top-level keys are the slime-style run settings (num_rollout, rollout_batch_size, ...);
sections group what belongs to one component (model, data, reward, compress, engine,
optim, loss, eval, log, dist). Each field's type carries its allowed values (Literal) or
range (Rule; compress.algorithm's Rule is its form), and HELP says what a key means where a
command-line flag sets it; load.py beside this reads, overrides and validates a Config;
cli.py builds the flags from all three.
"""
from __future__ import annotations

import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

# The shipped compression rules: one file per rule in this folder, named as
# compress.algorithm names it (a rule of the user's own is module.path:ClassName).
RULES_DIR = Path(__file__).resolve().parents[1] / "compression" / "rules"


def rule_names() -> tuple[str, ...]:
    """The compression rules, by file name (listed, not imported: the schema stays cheap
    to load, and the rules import it)."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules([str(RULES_DIR)])
                        if not m.name.startswith("_")))


# Allowed values of the string settings: validation and every CLI's `choices` read these.
Dtype = Literal["bfloat16", "float16", "float32"]
DivideMethod = Literal["step_length", "newline"]
Pooling = Literal["max", "avg"]
GroupPooling = Literal["max", "mean"]
Selection = Literal["per_head", "per_layer"]
Backend = Literal["native", "sglang"]
LrSchedule = Literal["constant", "cosine", "linear"]
Advantage = Literal["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
KlType = Literal["low_var_kl", "k1", "k2", "k3"]
Aggregation = Literal["sample_mean", "token_mean"]
TisLevel = Literal["token", "sequence", "geometric"]
TisMode = Literal["truncate", "clip", "mask"]
PromptTemplate = Literal["boxed", "chat", "user"]  # user: a synthetic training row's turn
Resume = Literal["auto", "never"]
# Training-pass attention over packed rows (models/attention.py).
Attention = Literal["auto", "flash_attn", "varlen", "sdpa"]
# Operators of the generated arithmetic (data/synthetic.py; * is rendered as \times).
Operator = Literal["+", "-", "*"]
# Liger Kernel's fused RMSNorm, SwiGLU and RoPE in the training passes (models/liger.py).
Switch = Literal["auto", "on", "off"]
# A switch the memory plan (trainer/memory/plan.py) sets when auto; YAML's true/false work too.
AutoBool = Literal["auto", "true", "false"]
# Where AdamW's state and step live (optimizer_offload): true: its state waits on the CPU
# during the update's forward/backward, its step on the GPU; cpu_adam: state and step on
# the CPU (DeepSpeed ZeRO-Offload's CPU Adam; zero_stage auto takes ZeRO 1 where it fits,
# one gradient copy to the CPU a step); auto: the memory plan's choice.
OptimizerOffload = Literal["auto", "true", "false", "cpu_adam"]
# DeepSpeed's ZeRO stage; auto: the memory plan's choice between 1 and 2.
ZeroStage = Literal["auto", 0, 1, 2, 3]


def choices(kind: object) -> tuple[str, ...]:
    """The allowed values of one of the Literal types above (e.g. for argparse choices)."""
    return get_args(kind)


@dataclass(frozen=True)
class Rule:
    """A field's range (or a string's form), checked by validate_config (a None value
    passes)."""
    text: str  # what the value must be, as the error message says it
    ok: Callable[[Any], bool]


Count = Annotated[int, Rule(">= 1", lambda v: v >= 1)]
NonNegativeInt = Annotated[int, Rule(">= 0", lambda v: v >= 0)]
NonNegative = Annotated[float, Rule(">= 0", lambda v: v >= 0)]
Fraction = Annotated[float, Rule("in [0, 1]", lambda v: 0 <= v <= 1)]
Share = Annotated[float, Rule("in (0, 1]", lambda v: 0 < v <= 1)]
Similarity = Annotated[float, Rule("in [-1, 1]", lambda v: -1 <= v <= 1)]
OddCount = Annotated[int, Rule("odd and >= 1", lambda v: v >= 1 and v % 2 == 1)]
TopK = Annotated[int, Rule("-1 (off) or >= 1", lambda v: v == -1 or v >= 1)]

# module.path:ClassName, a compression rule in the user's own importable module.
RULE_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def is_algorithm(value: str) -> bool:
    """Whether compress.algorithm has a valid form: none, a shipped rule or
    module.path:ClassName. The form alone: config/ imports no rule (it is the lowest
    layer); minisparse.compression's check_rule imports it before any model loads."""
    return value == "none" or value in rule_names() or bool(RULE_SPEC.fullmatch(value))


# compress.algorithm: none (dense rollouts), a shipped rule or a rule of the user's own.
Algorithm = Annotated[str, Rule(f"none, a shipped rule ({', '.join(rule_names())}) or "
                                f"module.path:ClassName", is_algorithm)]


# The decoder's linear layers (Qwen2 / Llama names) model.lora.target_modules may name.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    # LoRA adapters through PEFT (models/lora.py): only the adapters train (the optimizer
    # state is theirs alone), the reference policy is the frozen base (no copy), rollouts
    # sample with the merged weights; checkpoints hold the merged model (hf/) and the
    # adapters in PEFT's format (adapter/).
    enabled: bool = False
    rank: Count = 16
    alpha: Annotated[float, Rule("> 0", lambda v: v > 0)] = 32.0  # scale = alpha / rank
    dropout: Annotated[float, Rule("in [0, 1)", lambda v: 0 <= v < 1)] = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))


@dataclass
class ModelConfig:
    # "tiny" builds (and caches) a tiny random Qwen2 model + tokenizer locally; otherwise a
    # local HF checkpoint directory, a hub id (Qwen/Qwen2.5-3B-Instruct: fetched once into
    # the HF cache, models/hub.py), or a shape name (qwen2.5-3b, ...) for random weights.
    path: str = "tiny"
    dtype: Dtype = "bfloat16"
    # Recompute decoder layers' activations in the backward (HF's checkpointing): auto
    # checkpoints the fewest layers with which the memory plan finds the update fits (none
    # where it fits without); true every layer; false none.
    gradient_checkpointing: AutoBool = "auto"
    # Training-pass attention over packed rows, no mask: flash_attn: flash-attn-4's varlen
    # kernel (Hopper/Blackwell GPU, optional install; fails at start where it cannot run);
    # varlen: torch's flash varlen kernel on CUDA, one causal SDPA per sequence elsewhere;
    # auto: flash_attn where it can run, else varlen. sdpa: transformers' dense
    # block-diagonal mask over the packed row.
    attention: Attention = "auto"
    # LM head + log-softmax fused over chunks of this many tokens (models/fused_logprobs.py);
    # 0 materialises the [tokens x vocabulary] logits.
    logprob_chunk: NonNegativeInt = 1024
    # Liger Kernel's fused RMSNorm, SwiGLU and RoPE for the training passes: auto uses them
    # where liger-kernel is installed and the policy is on a GPU; on fails without them.
    liger_kernel: Switch = "auto"
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    # JSONL file, or "synthetic" for the generated arithmetic set the tiny configs use.
    path: str = "synthetic"
    input_key: str = "prompt"
    label_key: str = "label"
    shuffle: bool = True
    # Wrap plain-string prompts as one user message and apply the chat template.
    # Prompts that are already lists of messages always get the template.
    apply_chat_template: bool = False
    max_prompt_len: Count = 1024  # longer prompts are dropped (and counted in the log)
    # Rows no run can train on (an empty, NaN or infinite label, an empty prompt, bytes that
    # are not UTF-8, invalid JSON, a line too long to hold a prompt that fits) are left out
    # and counted in one line before any model loads; true: the first one stops the run.
    strict: bool = False
    synthetic_size: Count = 512  # rows generated when path == "synthetic"
    # The generated problems' difficulty (data/synthetic.py): operands of + and - up to
    # synthetic_max_operand (factors of x: 2..30, capped there), the operators drawn from,
    # and how many operations one problem chains.
    synthetic_max_operand: Count = 999
    synthetic_operators: list[str] = field(default_factory=lambda: ["+", "-", "*"])
    synthetic_operations: Count = 1


@dataclass
class RewardConfig:
    # Processes that grade a batch of responses, in training and evaluation (data/reward.py,
    # data/grading_pool.py); 0: one per two physical cores of this process's share of the
    # host, at most 8 (data/reward.py, grading_workers).
    workers: NonNegativeInt = 0
    # Seconds math-verify may spend on one answer before it scores 0 (its grading process
    # is killed just past this); a batch's grading is bounded by a budget built from it.
    timeout_s: Annotated[float, Rule("> 0", lambda v: v > 0)] = 2.0
    # Your own reward in place of the math grader: 'package.module:callable', called as
    # fn(response, label, metadata) -> number (data/reward_plugin.py); null: math-verify.
    function: str | None = None
    # DAPO's soft overlong punishment (arXiv 2503.14476): a response longer than
    # max_response_len - overlong_buffer tokens loses reward linearly with its length, up to
    # overlong_penalty at max_response_len (where it is cut off). 0: off. Without it a
    # right answer boxed inside a ramble that runs out of tokens scores 1, and the policy
    # may learn to ramble; rollout/accuracy stays the grader's.
    overlong_buffer: NonNegativeInt = 0
    overlong_penalty: NonNegative = 1.0


@dataclass
class CompressConfig:
    algorithm: Algorithm = "none"
    budget: Count = 512
    window: Count = 8
    divide_method: DivideMethod = "step_length"
    divide_length: Count = 128
    max_buffer: Count | None = None  # newline trigger's hard cap; None -> 4 * divide_length
    kernel_size: OddCount = 7
    pooling: Pooling = "max"
    group_pooling: GroupPooling = "max"
    mix_lambda: Fraction = 0.1
    sim_threshold: Similarity = 0.5
    selection: Selection = "per_head"
    n_sink: NonNegativeInt = 4  # streaming_llm: the first tokens, always kept
    # Never evict the prompt: the budget (and the trigger) count response tokens only, so
    # a compressed cache holds prompt + budget entries. Off, as in the Sparse-RL paper's
    # code: the prompt competes with the response for the budget.
    keep_prompt: bool = False


@dataclass
class EngineConfig:
    backend: Backend = "native"  # sglang: an embedded sglang.Engine, dense runs only
    page_size: Count = 16
    # KV pool size: kv_memory_gb if > 0, else this fraction of the free GPU memory at
    # wake-up, which also pays for the rollout-time fused weight copy (on CPU: of
    # kv_cpu_memory_gb).
    kv_memory_fraction: Share = 0.8
    kv_memory_gb: NonNegative = 0.0
    kv_cpu_memory_gb: NonNegative = 1.0
    max_num_seqs: Count = 512
    max_prefill_tokens: Count = 16384  # tokens per prefill batch
    max_model_len: Count | None = None  # None: the model's max_position_embeddings
    cuda_graphs: bool = True
    # On CUDA, the forward's elementwise stages (residual add + RMSNorm, RoPE + K/V write,
    # SiLU x up) run as fused Triton kernels; false: as PyTorch ops (the ablation).
    fused_kernels: bool = True
    # Launch decode step N + 1 before reading step N's tokens, so the host's per-step work
    # overlaps the device's (same tokens either way; see LLMEngine._decode).
    overlap_decode: bool = True
    # The n samples of a prompt prefill it once: later samples start from a sibling's
    # cached prompt (dense: the same pages, paid once; compressed: a copy).
    share_prompt_cache: bool = True

    def context_len(self, max_position: int) -> int:
        """Longest sequence (prompt + response) a backend serves for a model whose
        positions end at max_position: max_model_len, never past the model's own limit."""
        return min(self.max_model_len or max_position, max_position)


@dataclass
class OptimConfig:
    lr: NonNegative = 1e-6
    lr_schedule: LrSchedule = "constant"
    warmup_steps: NonNegativeInt = 0
    min_lr: NonNegative = 0.0
    weight_decay: NonNegative = 0.1
    adam_beta1: Fraction = 0.9
    adam_beta2: Fraction = 0.98
    adam_eps: NonNegative = 1e-8
    grad_clip: NonNegative = 1.0


@dataclass
class LossConfig:
    advantage: Advantage = "grpo"
    normalize_advantage_std: bool = True  # False: Dr.GRPO (no division by the group std)
    eps_clip: NonNegative = 0.2
    eps_clip_high: NonNegative | None = None  # None -> eps_clip
    # advantage=gspo clips its sequence-level ratio to [1 - low, 1 + high] instead
    # (the GSPO paper's values; eps_clip/eps_clip_high are for token-level ratios).
    gspo_eps_clip: NonNegative = 3e-4
    gspo_eps_clip_high: NonNegative = 4e-4
    kl_coef: NonNegative = 1e-4
    kl_type: KlType = "low_var_kl"
    entropy_coef: NonNegative = 0.0
    aggregation: Aggregation = "sample_mean"
    # Sparse-RL corrections (sampler log-probs vs dense old log-probs).
    use_tis: bool = True
    tis_level: TisLevel = "token"
    tis_mode: TisMode = "truncate"
    tis_upper: NonNegative = 1.5
    tis_lower: NonNegative = 0.5
    use_rs: bool = True
    # Rejection's level: a token leaves when its own ratio is out of bounds (token), or a
    # whole sequence when its product of ratios (sequence) or their geometric mean
    # (geometric, the sequence-masked form verl and TRL default to) is. None: tis_level.
    rs_level: TisLevel | None = None
    rs_lower: NonNegative | None = None  # None -> tis_lower
    rs_upper: NonNegative | None = None  # None -> tis_upper
    rs_veto_threshold: NonNegative = 1e-4
    normalize_weights: bool = True  # divide weights by their batch mean over valid tokens

    def rejection_level(self) -> str:
        """The level rejection compares its bounds at: rs_level, or tis_level."""
        return self.tis_level if self.rs_level is None else self.rs_level

    def rs_bounds(self) -> tuple[float, float]:
        """Rejection sampling's [lower, upper]: rs_lower/rs_upper, or the TIS bounds."""
        return (self.tis_lower if self.rs_lower is None else self.rs_lower,
                self.tis_upper if self.rs_upper is None else self.rs_upper)


@dataclass
class EvalConfig:
    benchmarks: list[str] = field(default_factory=list)  # empty: the paper's seven
    data_dir: str = "data/eval"  # NAME/test.jsonl per benchmark; see docs/eval.md
    limit: Count | None = None
    max_new_tokens: Count | None = None  # None: each benchmark's protocol value
    temperature: NonNegative = 0.8
    top_p: Share = 0.95
    n_samples: Count | None = None  # None: each benchmark's protocol value (32 on aime24/amc23)
    prompt_template: PromptTemplate = "boxed"  # boxed | chat | user (synthetic rows' turn)
    # In-training evaluation (eval_interval) through the rollout engine: with its KV
    # compression (true), or a dense cache (false), so that runs trained with and without
    # compression are scored alike. eval.py sets compression with its own flags.
    compress: bool = False


@dataclass
class LogConfig:
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "minisparse"
    run_name: str | None = None
    # Peak dense TFLOP/s per GPU for perf/*_mfu; 0: by device name (models/flops.py).
    peak_tflops: NonNegative = 0.0
    # Show the libraries' own output too: DeepSpeed's start-up lines, transformers' loading
    # and saving bars and tokenizer warnings (minisparse/utils/quiet.py); off: the run's alone.
    verbose: bool = False


@dataclass
class DistConfig:
    # Seconds a collective (all-reduce, gather, barrier) may take once every rank has
    # reached it: a rank done first waits for the others in torchrun's store, without this
    # limit, for as long as their heartbeats come (utils/peers.py). Past it, the error.
    timeout_s: Annotated[float, Rule("> 0", lambda v: v > 0)] = 600.0
    # Seconds a rank may go without a heartbeat through the store before the others take
    # it for dead or frozen (kill -9, kill -STOP, its node down or cut off), stop and say
    # which rank it was, the newest checkpoint and the command that resumes.
    peer_timeout_s: Annotated[float, Rule(">= 2", lambda v: v >= 2)] = 120.0


@dataclass
class Config:
    # Rollout shape (slime's constraint: rollout_batch_size * n_samples_per_prompt ==
    # global_batch_size * num_steps_per_rollout).
    num_rollout: Count = 100
    rollout_batch_size: Count = 128
    n_samples_per_prompt: Count = 8
    max_response_len: Count = 4096
    temperature: NonNegative = 1.0
    top_p: Share = 1.0
    top_k: TopK = -1
    # DAPO's dynamic sampling: draw more prompts, in rounds of rollout_batch_size, until
    # the batch holds only groups whose rewards differ (grpo/dynamic_sampling.py); at
    # most dynamic_sampling_max_rounds rounds, then zero-signal groups fill the rest.
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: Count = 4
    global_batch_size: Count = 256
    num_steps_per_rollout: Count = 4
    max_tokens_per_gpu: Count = 8192
    # tokens a micro-batch of the log-prob passes (old policy, reference; no gradients)
    # holds; 0: auto, max(max_tokens_per_gpu, 16384), less where the memory plan finds they
    # would not fit (no plan: max_tokens_per_gpu). Short micro-batches leave those passes
    # bound by their kernel launches (slime: --log-probs-max-tokens-per-gpu).
    logprob_max_tokens_per_gpu: NonNegativeInt = 0
    # auto: ZeRO 1 (one gradient reduction a step) where the memory plan finds it costs
    # nothing ZeRO 2 would not (no more checkpointed layers, no optimizer offload, the
    # training state kept through rollouts as under 2, the same log-prob micro-batches);
    # else ZeRO 2, whose gradient partition holds 1/N of the gradients. No plan: ZeRO 2.
    zero_stage: ZeroStage = "auto"
    # true: AdamW moments and fp32 master weights wait on the CPU during the update's forward
    # and backward passes, back for each optimizer step; cpu_adam: they stay on the CPU and
    # the step runs there (DeepSpeed's CPU Adam, under ZeRO 1 where it fits, else ZeRO 2;
    # JIT-built with g++ and ninja), the GPU keeps the bf16 weights and gradient buckets;
    # auto: the memory plan's choice, true or cpu_adam only where nothing else fits.
    optimizer_offload: OptimizerOffload = "auto"
    # GiB of GPU memory the memory plan may count on; 0: what is free on the GPU at start.
    # Without a GPU, a value > 0 plans (and checks) for a GPU of that size.
    gpu_memory_gb: NonNegative = 0.0
    seed: NonNegativeInt = 42
    # torch's CPU threads; 0: chosen at start (utils/threads.py): one per physical core,
    # fewer where other work keeps cores busy, OMP_NUM_THREADS where it is set.
    cpu_threads: NonNegativeInt = 0
    output_dir: str = "outputs/run"
    save_interval: NonNegativeInt = 10
    save_total_limit: Count | None = None  # keep the newest N complete checkpoints; None: all
    eval_interval: NonNegativeInt = 0  # 0: no evaluation during training
    # Score cfg.eval once before the first rollout too (metrics.jsonl's row of rollout 0),
    # so every run's curve starts from the model it trained; redone on a fresh start only.
    eval_before_training: bool = False
    resume: Resume = "auto"
    max_nonfinite_steps: NonNegativeInt = 3
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    compress: CompressConfig = field(default_factory=CompressConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    dist: DistConfig = field(default_factory=DistConfig)  # under torchrun


# What a key means, as the --help of the command-line flag that sets it says it (eval.py
# and the engine bench take flags for these; config/cli.py adds the type, choices, range
# and default from the field itself).
HELP = {
    "seed": "seed of the run's random numbers: sampling and data order",
    "cpu_threads": "torch's CPU threads; 0: one per physical core, fewer where other work "
                   "keeps cores busy (OMP_NUM_THREADS, where set, is kept)",
    "temperature": "rollout sampling temperature",
    "top_p": "rollout nucleus sampling: the probability mass kept",
    "top_k": "rollout top-k sampling: the most likely tokens kept",
    "model.path": "HF checkpoint dir, or hub id (Qwen/Qwen2.5-3B-Instruct: fetched once "
                  "into the HF cache); tiny: a tiny random model built locally; or a shape "
                  "name such as qwen2.5-3b for random weights",
    "model.dtype": "weights' dtype",
    "compress.algorithm": "KV-cache compression during generation (none: dense; rkv: "
                          "R-KV); a rule of your own is a ScoringRule subclass in an "
                          "importable module, see docs/compression.md",
    "compress.budget": "KV tokens a sequence keeps after each compression",
    "compress.window": "recent tokens always kept; rules that score with queries use "
                       "theirs",
    "compress.divide_method": "when to compress: every divide-length generated tokens "
                              "(step_length) or after a newline (newline)",
    "compress.divide_length": "step_length: generated tokens between compressions",
    "compress.max_buffer": "newline: tokens past the budget that force a compression; "
                           "unset: 4 x divide-length",
    "compress.kernel_size": "width of the pooling over token scores",
    "compress.pooling": "pooling over token scores",
    "compress.group_pooling": "how the query heads of a KV head combine their scores",
    "compress.mix_lambda": "R-KV's weight of attention importance; 1 - lambda weighs "
                           "redundancy",
    "compress.sim_threshold": "R-KV: key cosine similarity above which a token counts as "
                              "redundant",
    "compress.selection": "per_head: each KV head keeps its own tokens; per_layer: one set "
                          "per layer",
    "compress.n_sink": "streaming_llm: attention-sink tokens (the first ones) always kept",
    "compress.keep_prompt": "never evict prompt tokens; the budget counts response tokens "
                            "only",
    "reward.workers": "grading processes; 0: one per two physical cores of this process's "
                      "share of the host, at most 8",
    "reward.timeout_s": "seconds math-verify may spend on one answer before it scores 0",
    "engine.backend": "rollout engine; sglang (an embedded sglang.Engine) is dense only",
    "engine.page_size": "tokens per KV-cache page",
    "engine.kv_memory_gb": "KV pool size in GiB; 0: kv-memory-fraction decides",
    "engine.kv_memory_fraction": "share of the free GPU memory that the KV pool (and the "
                                 "fused weight copy) takes when kv-memory-gb is 0",
    "engine.kv_cpu_memory_gb": "KV pool size in GiB on CPU",
    "engine.max_num_seqs": "sequences decoded at once",
    "engine.max_prefill_tokens": "tokens per prefill batch",
    "engine.cuda_graphs": "replay decode steps from CUDA graphs",
    "engine.fused_kernels": "run the forward's elementwise stages as the engine's Triton "
                            "kernels on CUDA (off: PyTorch ops, the ablation)",
    "engine.overlap_decode": "launch each decode step before reading the last one's tokens",
    "engine.share_prompt_cache": "the n samples of a prompt prefill it once",
    "data.synthetic_max_operand": "generated arithmetic: operands of + and - are drawn "
                                  "from 1..N (factors of x from 2..min(30, N))",
    "data.synthetic_operators": "generated arithmetic: comma-separated operators drawn "
                                "from (+, -, *)",
    "data.synthetic_operations": "generated arithmetic: operators per problem (2: a + b - c)",
    "eval.benchmarks": "comma-separated benchmark names; unset: the paper's seven (gsm8k, "
                       "math500, minerva_math, olympiadbench, aime24, amc23, gaokao2023en)",
    "eval.data_dir": "folder with NAME/test.jsonl per benchmark, see docs/eval.md",
    "eval.limit": "problems of each benchmark, from the first; unset: all",
    "eval.max_new_tokens": "new tokens per sample on every benchmark; unset: each "
                           "benchmark's protocol value, 8192 or 16384 on aime24 and amc23",
    "eval.temperature": "sampling temperature",
    "eval.top_p": "nucleus sampling: the probability mass kept",
    "eval.n_samples": "samples per problem on every benchmark; unset: each benchmark's "
                      "protocol value, 1 or 32 on aime24 and amc23",
    "eval.prompt_template": "boxed: question + instruction, no chat template; chat: the "
                            "training set's system/user turn in the chat template; user: "
                            "one user turn as data.path=synthetic renders it, for the "
                            "arithmetic set",
}


class ConfigError(ValueError):
    """A bad config: raised before any model or data is touched, naming the key."""
