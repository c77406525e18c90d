"""Policy loading: the tiny model, random-weight architectures by name, a local HF dir,
or a hub id (models/hub.py), all resolved by check_model_path.

Shape models let memory and throughput be measured at the paper's sizes without
downloading weights; they are built on the meta device and initialised in place so a
7B model appears in seconds, not minutes.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from minisparse.config.schema import Dtype, choices

if TYPE_CHECKING:
    import torch

_QWEN_COMMON = dict(
    vocab_size=151936,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    rms_norm_eps=1e-6,
    hidden_act="silu",
    bos_token_id=151643,
    eos_token_id=151643,
)

# Published config.json values (architecture only; no weights).
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-1.5b": ("qwen2", dict(
        _QWEN_COMMON, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, intermediate_size=8960, max_position_embeddings=131072,
        tie_word_embeddings=True)),
    "qwen2.5-3b": ("qwen2", dict(
        _QWEN_COMMON, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=2, intermediate_size=11008, max_position_embeddings=32768,
        tie_word_embeddings=True)),
    "qwen2.5-7b": ("qwen2", dict(
        _QWEN_COMMON, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, intermediate_size=18944, max_position_embeddings=131072,
        tie_word_embeddings=False)),
    "llama-3.2-1b": ("llama", dict(
        vocab_size=128256, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, intermediate_size=8192,
        max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu",
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192})),
}

DTYPES = choices(Dtype)


def shape_config(name: str, **overrides: Any):
    """The transformers config of a named shape (Qwen2Config or LlamaConfig). Overrides go
    to the constructor: setting num_hidden_layers afterwards leaves layer_types at the
    full depth, which a save/reload (the SGLang backend's) then rejects."""
    from transformers import LlamaConfig, Qwen2Config

    family, kwargs = SHAPES[name]
    cls = Qwen2Config if family == "qwen2" else LlamaConfig
    return cls(**(kwargs | overrides))


def _torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return getattr(torch, dtype)


def _init_in_place(model, device) -> None:
    """Materialise a meta-device model on `device`: N(0, 0.02) weights, unit norms, zero
    biases, and rotary buffers recomputed (to_empty leaves them uninitialised).

    The weights come from their own generator, seeded with 0 on every rank: train.py seeds
    the global one by rank (sampling), and a reference model copied from rank-seeded
    weights differs on every rank but 0 once DeepSpeed broadcasts rank 0's policy (a KL
    of 0.35 before any step, on two ranks)."""
    import torch

    model.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
        for module in model.modules():
            if hasattr(module, "inv_freq") and hasattr(module, "config"):
                fresh = type(module)(module.config)
                for key, buf in fresh.named_buffers(recurse=False):
                    getattr(module, key).copy_(buf.to(device))
    model.tie_weights()


def build_shape_model(name: str, dtype: str = "bfloat16", device: Any = "cpu"):
    """Random-weight model of a named shape, the same on every rank and run; device="meta"
    gives it without memory."""
    import torch
    from transformers import AutoModelForCausalLM

    config = shape_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=_torch_dtype(dtype))
    if str(device) != "meta":
        _init_in_place(model, torch.device(device))
    return model


def missing_model_message(path: str) -> str:
    """Why `path` is no model, and the command that writes it when its folder is named
    after a model minisparse.download knows (checkpoints/smollm2-135m-instruct)."""
    from minisparse.models.gguf_sources import MODELS

    where = Path(path)
    if where.name in MODELS:
        return (f"model path '{path}' holds no model (no config.json there); download it "
                f"with: python -m minisparse.download --model {where.name} "
                f"--out {where.parent}/")
    return (f"model path '{path}' is not a local HF checkpoint directory (no config.json "
            f"there) nor a hub id (owner/name); shapes available: {', '.join(SHAPES)}, "
            f"or 'tiny'")


def check_model_path(path: str) -> Path | None:
    """The local checkpoint directory of model.path (None for 'tiny' and SHAPES names,
    which are built, not read): a folder holding config.json, or a hub id's folder in
    the HF cache (fetched there first: models/hub.py); fails naming the path otherwise.
    The one place model.path is resolved: pre-flight, the memory plan, loading, eval."""
    from minisparse.models.gguf_sources import MODELS
    from minisparse.models.hub import hub_model_dir, is_hub_id

    if path == "tiny" or path in SHAPES:
        return None
    if (Path(path) / "config.json").is_file():
        return Path(path)
    if is_hub_id(path) and Path(path).name not in MODELS:
        return hub_model_dir(path)
    raise FileNotFoundError(missing_model_message(path))


def attention_heads(config: Any) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of an HF decoder config: head_dim and
    num_key_value_heads are optional there (hidden / heads and one KV head per query head)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, getattr(config, "num_key_value_heads", None) or heads, head_dim


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """K and V bytes one cached token holds over all layers of an HF config's model."""
    _, kv_heads, head_dim = attention_heads(config)
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def model_config(path: str):
    """The transformers config of model.path ("tiny", a SHAPES name, a local HF
    directory or a hub id), without its weights: the memory plan reads the shape from it."""
    from transformers import AutoConfig

    if path in SHAPES:
        return shape_config(path)
    return AutoConfig.from_pretrained(_local_dir(path), local_files_only=True)


def _local_dir(path: str) -> Path:
    """The HF directory of "tiny" (built and cached), of a local checkpoint or of a hub
    id (in the HF cache)."""
    from minisparse.models.tiny import build_tiny

    return build_tiny() if path == "tiny" else check_model_path(path)


def load_policy(path: str, dtype: str = "bfloat16", device: Any = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) for "tiny", a SHAPES name, a local HF checkpoint directory or
    a hub id (fetched into the HF cache once, then read from there).

    transformers reads only local files (local_files_only): the hub is asked, if at all,
    by check_model_path alone.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minisparse.models.tiny import build_tokenizer

    if path in SHAPES:
        model = build_shape_model(path, dtype, device)
        tokenizer = build_tokenizer(vocab_size=model.config.vocab_size)
    else:
        local = _local_dir(path)
        model = AutoModelForCausalLM.from_pretrained(
            local, dtype=_torch_dtype(dtype), local_files_only=True
        ).to(device)
        tokenizer = AutoTokenizer.from_pretrained(local, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
