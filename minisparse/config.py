"""The run configuration: one dataclass tree that YAML files, `--set` overrides and every
module share, so a key means the same thing in train.py, eval.py and the engine.

Top-level keys are the slime-style run settings (num_rollout, rollout_batch_size, ...);
sections group what belongs to one component (model, data, compress, engine, optim, loss,
eval, log). Loading, overrides and validation live in this module too (see below).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    # "tiny" builds (and caches) a tiny random Qwen2 model + tokenizer locally; otherwise a
    # local HF checkpoint directory, or a shape name (qwen2.5-3b, ...) for random weights.
    path: str = "tiny"
    dtype: str = "bfloat16"  # bfloat16 | float16 | float32
    gradient_checkpointing: bool = False
    # Training-pass attention over packed rows: varlen (flash varlen kernel on CUDA, one
    # causal SDPA per sequence elsewhere; no mask) | sdpa (transformers' dense packed mask).
    attention: str = "varlen"
    # LM head + log-softmax fused over chunks of this many tokens (grpo/fused_logprobs.py);
    # 0 materialises the [tokens x vocabulary] logits.
    logprob_chunk: int = 1024


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
    max_prompt_len: int = 1024  # longer prompts are dropped (and counted in the log)
    synthetic_size: int = 512  # rows generated when path == "synthetic"


@dataclass
class CompressConfig:
    algorithm: str = "none"  # none | rkv | snapkv
    budget: int = 512
    window: int = 8
    divide_method: str = "step_length"  # step_length | newline
    divide_length: int = 128
    max_buffer: int | None = None  # newline trigger's hard cap; None -> 4 * divide_length
    kernel_size: int = 7
    pooling: str = "max"  # max | avg
    group_pooling: str = "max"  # max | mean
    mix_lambda: float = 0.1
    sim_threshold: float = 0.5
    selection: str = "per_head"  # per_head | per_layer


@dataclass
class EngineConfig:
    backend: str = "native"  # native | sglang (embedded sglang.Engine; dense runs only)
    page_size: int = 16
    # KV pool size: kv_memory_gb if > 0, else this fraction of the free GPU memory
    # (on CPU: of kv_cpu_memory_gb).
    kv_memory_fraction: float = 0.8
    kv_memory_gb: float = 0.0
    kv_cpu_memory_gb: float = 1.0
    max_num_seqs: int = 512
    max_prefill_tokens: int = 16384  # tokens per prefill batch
    cuda_graphs: bool = True


@dataclass
class OptimConfig:
    lr: float = 1e-6
    lr_schedule: str = "constant"  # constant | cosine | linear
    warmup_steps: int = 0
    min_lr: float = 0.0
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass
class LossConfig:
    advantage: str = "grpo"  # grpo
    normalize_advantage_std: bool = True  # False: Dr.GRPO (no division by the group std)
    eps_clip: float = 0.2
    eps_clip_high: float | None = None  # None -> eps_clip
    kl_coef: float = 1e-4
    kl_type: str = "low_var_kl"  # low_var_kl | k1 | k2 | k3
    entropy_coef: float = 0.0
    aggregation: str = "sample_mean"  # sample_mean | token_mean
    # Sparse-RL corrections (sampler log-probs vs dense old log-probs).
    use_tis: bool = True
    tis_level: str = "token"  # token | sequence | geometric
    tis_mode: str = "truncate"  # truncate | clip | mask
    tis_upper: float = 1.5
    tis_lower: float = 0.5
    use_rs: bool = True
    rs_lower: float | None = None  # None -> tis_lower
    rs_upper: float | None = None  # None -> tis_upper
    rs_veto_threshold: float = 1e-4
    normalize_weights: bool = True  # divide weights by their batch mean over valid tokens


@dataclass
class EvalConfig:
    benchmarks: list[str] = field(default_factory=list)  # empty: the paper's seven
    data_dir: str = "data/eval"  # NAME/test.jsonl per benchmark; see docs/eval.md
    limit: int | None = None
    max_new_tokens: int | None = None  # None: each benchmark's protocol value
    temperature: float = 0.8
    top_p: float = 0.95
    n_samples: int | None = None  # None: each benchmark's protocol value (32 on aime24/amc23)
    prompt_template: str = "boxed"  # boxed | chat


@dataclass
class LogConfig:
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "minisparse"
    run_name: str | None = None
    # Peak dense TFLOP/s per GPU for perf/*_mfu; 0: by device name (grpo/flops.py).
    peak_tflops: float = 0.0


@dataclass
class Config:
    # Rollout shape (slime's constraint: rollout_batch_size * n_samples_per_prompt ==
    # global_batch_size * num_steps_per_rollout).
    num_rollout: int = 100
    rollout_batch_size: int = 128
    n_samples_per_prompt: int = 8
    max_response_len: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    global_batch_size: int = 256
    num_steps_per_rollout: int = 4
    max_tokens_per_gpu: int = 8192
    zero_stage: int = 2
    seed: int = 42
    output_dir: str = "outputs/run"
    save_interval: int = 10
    save_total_limit: int | None = None  # keep the newest N complete checkpoints; None: all
    eval_interval: int = 0  # 0: no evaluation during training
    resume: str = "auto"  # auto | never
    max_nonfinite_steps: int = 3
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    compress: CompressConfig = field(default_factory=CompressConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)


# --------------------------------------------------------------------------------------
# Loading, overrides, validation, CLI
# --------------------------------------------------------------------------------------
import argparse  # noqa: E402  (kept below the schema so the dataclasses read first)
import dataclasses  # noqa: E402
import difflib  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
import typing  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import yaml  # noqa: E402

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"

ENUMS: dict[str, tuple[str, ...]] = {
    "model.dtype": ("bfloat16", "float16", "float32"),
    "model.attention": ("varlen", "sdpa"),
    "compress.algorithm": ("none", "rkv", "snapkv"),
    "compress.divide_method": ("step_length", "newline"),
    "compress.pooling": ("max", "avg"),
    "compress.group_pooling": ("max", "mean"),
    "compress.selection": ("per_head", "per_layer"),
    "engine.backend": ("native", "sglang"),
    "optim.lr_schedule": ("constant", "cosine", "linear"),
    "loss.advantage": ("grpo",),
    "loss.kl_type": ("low_var_kl", "k1", "k2", "k3"),
    "loss.aggregation": ("sample_mean", "token_mean"),
    "loss.tis_level": ("token", "sequence", "geometric"),
    "loss.tis_mode": ("truncate", "clip", "mask"),
    "eval.prompt_template": ("boxed", "chat"),
    "resume": ("auto", "never"),
}


class ConfigError(ValueError):
    """A bad config: raised before any model or data is touched, naming the key."""


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key, sections included, for 'did you mean' suggestions."""
    keys = []
    for name, hint in _hints(cls).items():
        keys.append(prefix + name)
        if dataclasses.is_dataclass(hint):
            keys.extend(_all_keys(hint, prefix + name + "."))
    return keys


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, _all_keys(), n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


def _split_optional(hint: Any) -> tuple[Any, bool]:
    """(inner type, None allowed) for `X | None`."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def _type_name(hint: Any) -> str:
    inner, optional = _split_optional(hint)
    name = getattr(inner, "__name__", str(inner))
    if typing.get_origin(inner) is list:
        name = "list of " + typing.get_args(inner)[0].__name__
    return name + (" or null" if optional else "")


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check one leaf value against its annotation; ints are fine where floats are."""
    inner, optional = _split_optional(hint)
    if value is None and optional:
        return None
    if typing.get_origin(inner) is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
    elif inner is bool:
        if isinstance(value, bool):
            return value
    elif inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif inner is float:
        if isinstance(value, str):  # PyYAML reads "1e-6" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value):
            return float(value)
    elif inner is str:
        if isinstance(value, str):
            return value
    raise ConfigError(
        f"config key '{key}' expects {_type_name(hint)}, got {value!r} ({type(value).__name__})"
    )


def _build(cls: type, raw: Any, prefix: str = "") -> Any:
    """Dataclass from a nested mapping; missing keys keep their defaults."""
    if not isinstance(raw, dict):
        where = f"section '{prefix[:-1]}'" if prefix else "the config file"
        raise ConfigError(f"{where} must be a mapping, got {type(raw).__name__}")
    hints = _hints(cls)
    kwargs = {}
    for name, value in raw.items():
        key = prefix + str(name)
        if name not in hints:
            raise _unknown(key)
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, {} if value is None else value, key + ".")
        else:
            kwargs[name] = _coerce(key, value, hint)
    return cls(**kwargs)


def _leaf_hint(key: str) -> Any:
    """Annotation of a dotted leaf key; ConfigError for unknown keys and bare sections."""
    cls: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        hints = _hints(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in hints:
            raise _unknown(key)
        cls = hints[part]
        if dataclasses.is_dataclass(cls) and i == len(parts) - 1:
            raise ConfigError(f"config key '{key}' is a section; set its keys ('{key}.x=...')")
    return cls


def _parse_override(item: str) -> tuple[str, Any]:
    """`a.b=value` -> (key, value); str-typed keys keep the raw text ('yes' stays 'yes')."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like KEY=VALUE")
    key, text = (s.strip() for s in item.split("=", 1))
    hint = _leaf_hint(key)
    inner, optional = _split_optional(hint)
    if inner is str and not (optional and text in ("null", "None", "~")):
        return key, text
    try:
        return key, yaml.safe_load(text) if text else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"config key '{key}': cannot parse value {text!r}: {exc}") from None


def _apply_overrides(raw: dict, overrides: Sequence[str]) -> None:
    for item in overrides:
        key, value = _parse_override(item)
        *sections, leaf = key.split(".")
        node = raw
        for section in sections:
            child = node.get(section)
            if not isinstance(child, dict):
                child = node[section] = {}
            node = child
        node[leaf] = value


def resolve_config_path(name: str) -> Path:
    """An existing path as is, else configs/NAME[.yaml] relative to the repo root."""
    path = Path(name)
    if path.is_file():
        return path
    candidate = CONFIGS_DIR / (name if name.endswith((".yaml", ".yml")) else name + ".yaml")
    if candidate.is_file():
        return candidate
    available = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
    raise ConfigError(
        f"config '{name}' not found (neither a file nor {candidate}); "
        f"available configs: {', '.join(available) or '(none)'}"
    )


def load_config(name_or_path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """YAML file (or defaults for None), then KEY=VALUE overrides, then validation."""
    raw: dict = {}
    if name_or_path is not None:
        path = resolve_config_path(name_or_path)
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config {path} must be a mapping at the top level")
    _apply_overrides(raw, overrides)
    cfg = _build(Config, raw)
    validate_config(cfg)
    return cfg


def _get(cfg: Config, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


_POSITIVE = (
    "num_rollout rollout_batch_size n_samples_per_prompt max_response_len global_batch_size "
    "num_steps_per_rollout max_tokens_per_gpu data.max_prompt_len data.synthetic_size "
    "compress.budget compress.window compress.divide_length compress.kernel_size "
    "engine.page_size engine.max_num_seqs engine.max_prefill_tokens eval.max_new_tokens "
    "eval.n_samples eval.limit compress.max_buffer save_total_limit"
).split()
_NON_NEGATIVE = (
    "seed save_interval eval_interval max_nonfinite_steps temperature eval.temperature "
    "model.logprob_chunk log.peak_tflops "
    "engine.kv_memory_gb engine.kv_cpu_memory_gb optim.lr optim.warmup_steps optim.min_lr "
    "optim.weight_decay optim.adam_eps optim.grad_clip loss.eps_clip loss.eps_clip_high "
    "loss.kl_coef loss.entropy_coef loss.tis_lower loss.tis_upper loss.rs_lower "
    "loss.rs_upper loss.rs_veto_threshold"
).split()
_FRACTIONS = "compress.mix_lambda optim.adam_beta1 optim.adam_beta2".split()
_OPEN_FRACTIONS = "top_p eval.top_p engine.kv_memory_fraction".split()  # in (0, 1]


def _check_ranges(cfg: Config) -> None:
    for key in _POSITIVE:
        value = _get(cfg, key)
        if value is not None and value < 1:
            raise ConfigError(f"config key '{key}' must be >= 1, got {value}")
    for key in _NON_NEGATIVE:
        value = _get(cfg, key)
        if value is not None and value < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {value}")
    for key in _FRACTIONS:
        if not 0 <= _get(cfg, key) <= 1:
            raise ConfigError(f"config key '{key}' must be in [0, 1], got {_get(cfg, key)}")
    for key in _OPEN_FRACTIONS:
        if not 0 < _get(cfg, key) <= 1:
            raise ConfigError(f"config key '{key}' must be in (0, 1], got {_get(cfg, key)}")
    if not -1 <= cfg.compress.sim_threshold <= 1:
        raise ConfigError(
            f"config key 'compress.sim_threshold' must be in [-1, 1], got {cfg.compress.sim_threshold}"
        )
    if cfg.top_k == 0 or cfg.top_k < -1:
        raise ConfigError(f"config key 'top_k' must be -1 (off) or >= 1, got {cfg.top_k}")
    if cfg.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"config key 'zero_stage' must be 0, 1, 2 or 3, got {cfg.zero_stage}")


def _check_bounds(lower_key: str, upper_key: str, lower: float, upper: float) -> None:
    if lower > upper:
        raise ConfigError(
            f"config key '{lower_key}' ({lower}) must be <= '{upper_key}' ({upper})"
        )


def _check_relations(cfg: Config) -> None:
    c, loss = cfg.compress, cfg.loss
    if cfg.engine.backend == "sglang" and c.algorithm != "none":
        raise ConfigError(
            f"config key 'engine.backend' is sglang but 'compress.algorithm' is "
            f"{c.algorithm!r}: SGLang cannot free evicted tokens from its KV cache, so "
            f"compressed rollouts need engine.backend=native (sglang is dense only)"
        )
    if c.algorithm != "none" and c.budget <= c.window:
        raise ConfigError(
            f"config key 'compress.budget' ({c.budget}) must be > 'compress.window' "
            f"({c.window}) when compression is on"
        )
    if c.max_buffer is not None and c.max_buffer < c.divide_length:
        raise ConfigError(
            f"config key 'compress.max_buffer' ({c.max_buffer}) must be >= "
            f"'compress.divide_length' ({c.divide_length})"
        )
    _check_bounds("loss.tis_lower", "loss.tis_upper", loss.tis_lower, loss.tis_upper)
    rs_lower = loss.tis_lower if loss.rs_lower is None else loss.rs_lower
    rs_upper = loss.tis_upper if loss.rs_upper is None else loss.rs_upper
    _check_bounds("loss.rs_lower", "loss.rs_upper", rs_lower, rs_upper)
    _check_bounds("optim.min_lr", "optim.lr", cfg.optim.min_lr, cfg.optim.lr)
    rollout = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    update = cfg.global_batch_size * cfg.num_steps_per_rollout
    if rollout != update:
        raise ConfigError(
            f"rollout_batch_size * n_samples_per_prompt ({cfg.rollout_batch_size} * "
            f"{cfg.n_samples_per_prompt} = {rollout}) must equal global_batch_size * "
            f"num_steps_per_rollout ({cfg.global_batch_size} * {cfg.num_steps_per_rollout} "
            f"= {update})"
        )


def validate_config(cfg: Config) -> None:
    """Enums, ranges and cross-key rules; cheap, so train.py fails before loading a model."""
    for key, allowed in ENUMS.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(
                f"config key '{key}' must be one of {', '.join(allowed)}; got {value!r}"
            )
    _check_ranges(cfg)
    _check_relations(cfg)


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config) -> str:
    """YAML that load_config reads back to an equal Config (saved next to checkpoints)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def add_config_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The config flags train.py and eval.py share."""
    parser.add_argument("--config", default=None,
                        help="config name under configs/ (e.g. qwen3b_rkv) or a YAML path")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE",
                        help="override a key, dotted for sections (compress.budget=256); "
                             "repeatable")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML and exit")
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    """Resolved Config; exits 2 with 'config error: ...' on a bad config, 0 after printing."""
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.print_config:
        print(dump_config(cfg), end="")
        raise SystemExit(0)
    return cfg
