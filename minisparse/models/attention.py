"""Packed variable-length causal attention for the training passes (log-probs, update).

A micro-batch is one row of several sequences back to back (logprobs.py). Under "sdpa"
transformers builds a dense [L, L] block-diagonal mask for such a row and SDPA then runs
a masked kernel over all L² pairs, the cross-sequence ones included. Here the
sequences' boundaries (cu_seqlens) go to a varlen kernel, which visits only each
sequence's causal triangle and has a backward:

* "flash_attn": flash-attn-4 (`flash_attn.cute.flash_attn_varlen_func`), written for
  Hopper and Blackwell GPUs and faster there than torch's kernel; an optional GPU
  install (requirements-flash-attn.txt). Its first call of a shape compiles for some seconds;
* "varlen": torch's own flash-attention varlen kernel (`torch.nn.attention.varlen`);
* "auto" (the default): flash-attn-4 where it can run this model here, else "varlen".

Off CUDA, in float32 (the kernels take bfloat16 or float16), or with a torch lacking its
kernel, the packed settings run one causal SDPA call per sequence. No mask is built
(transformers builds none for an attention it has no mask function for). A call without
packing information (one sequence per row) is plain causal SDPA.
"""

from __future__ import annotations

import importlib.util
import inspect
import warnings
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

from minisparse.config.schema import Attention, ConfigError, choices
from minisparse.models.loading import attention_heads
from minisparse.utils.transfer import to_device

NAME = "minisparse_varlen"  # torch's varlen kernel
# flash-attn-4's (no "flash" in the name: transformers takes such a name for its own kernels)
FLASH_NAME = "minisparse_fa4"
PACKED = (NAME, FLASH_NAME)  # the implementations that take packing_kwargs
# GPU generations flash-attn-4's kernels (forward and backward) are written for, by
# compute-capability major, with the largest head dim each takes.
FLASH_GPUS = {9: ("Hopper", 256), 10: ("Blackwell", 128)}
HALF = (torch.bfloat16, torch.float16)  # what the varlen kernels take; others run per sequence


def packing_kwargs(lengths: list[int], device: torch.device) -> dict:
    """What the model's forward passes on to the attention for sequences of these lengths
    packed into one row (transformers hands unknown forward kwargs to the attention)."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return {
        "packed_cu_seqlens": to_device(cu, device),
        "packed_max_seqlen": max(lengths),
        "packed_lengths": tuple(lengths),
    }


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@lru_cache(maxsize=1)
def _varlen_fn():
    """(varlen_attn, extra kwargs for causal GQA), or None where torch lacks it or it
    fails a first call on two short sequences against per-sequence SDPA (a warning says
    so). The keyword for causality changed between torch releases."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        warnings.warn("torch has no nn.attention.varlen: packed attention runs per sequence")
        return None
    params = inspect.signature(varlen_attn).parameters
    extra = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        extra["enable_gqa"] = True
    try:
        q, k, v = (torch.randn(1, h, 24, 64, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
        cu = torch.tensor([0, 9, 24], dtype=torch.int32, device="cuda")
        out = varlen_attn(*(t[0].transpose(0, 1).contiguous() for t in (q, k, v)), cu, cu, 15, 15,
                          scale=0.125, **extra)
        ref = _per_sequence_sdpa(q, k, v, (9, 15), 0.125)[0].transpose(0, 1)
        if not _relative_error(out, ref) <= 1e-2:
            raise RuntimeError("result differs from per-sequence SDPA")
    except (RuntimeError, TypeError) as exc:
        warnings.warn(f"torch varlen_attn unusable ({exc}): packed attention runs per sequence")
        return None
    return varlen_attn, extra


def _torch_varlen(q, k, v, cu_seqlens, max_seqlen, scale) -> torch.Tensor:
    fn, extra = _varlen_fn()
    return fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, **extra)


# What CuTe DSL (under flash-attn-4) says at each kernel build: it passes an argument
# type it cannot convert some other way. Four long lines a build in every run's log, and
# nothing a user can act on.
CUTE_BUILD_NOTICE = r"Argument aux_data \(position \d+\) cannot be converted to a JitArgument"


@lru_cache(maxsize=None)
def quiet_cute_builds() -> None:
    """Leave CuTe DSL's build notice out of the run's output (other warnings stay); once
    a process, as each new filter resets Python's record of warnings already shown."""
    warnings.filterwarnings("ignore", message=CUTE_BUILD_NOTICE, category=UserWarning)


def _flash_varlen(q, k, v, cu_seqlens, max_seqlen, scale) -> torch.Tensor:
    """flash-attn-4 on [T, H, D] rows; GQA (fewer KV heads) is native. Releases differ in
    returning out or (out, lse)."""
    from flash_attn.cute import flash_attn_varlen_func

    quiet_cute_builds()

    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                 max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                                 softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out


def _per_sequence_sdpa(query, key, value, lengths, scaling) -> torch.Tensor:
    """[B, H, L, D] causal attention within each sequence of `lengths` along L."""
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, sl], key[:, :, sl], value[:, :, sl],
                is_causal=True, scale=scaling, enable_gqa=True,
            )
        )
        start += n
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _packed_forward(kernel, query, key, value, attention_mask, dropout=0.0, scaling=None,
                    packed_cu_seqlens=None, packed_max_seqlen=None, packed_lengths=None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """q [B, Hq, L, D], k/v [B, Hkv, L, D] -> [B, L, Hq, D] through kernel on CUDA."""
    if attention_mask is not None or dropout:
        raise ValueError("packed attention takes neither a mask nor dropout")
    batch, _, length, _ = query.shape
    lengths = packed_lengths or (length,)
    if sum(lengths) != length or (packed_lengths and batch != 1):
        raise ValueError(
            f"packed lengths {list(lengths)} do not tile a row of {length} tokens (batch {batch})"
        )
    if (not (query.is_cuda and packed_lengths) or query.dtype not in HALF
            or (kernel is _torch_varlen and _varlen_fn() is None)):
        return _per_sequence_sdpa(query, key, value, lengths, scaling).transpose(1, 2), None
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [L, H, D]
    return kernel(q, k, v, packed_cu_seqlens, packed_max_seqlen, scaling)[None], None


# transformers' attention interface, packing from packing_kwargs(): (module, query, key,
# value, attention_mask, dropout=, scaling=, packed_*=) -> (output, None).
def varlen_attention_forward(module: torch.nn.Module | None, query: Tensor, key: Tensor,
                             value: Tensor, attention_mask: Tensor | None,
                             **kwargs) -> tuple[Tensor, None]:
    return _packed_forward(_torch_varlen, query, key, value, attention_mask, **kwargs)


def flash_attention_forward(module: torch.nn.Module | None, query: Tensor, key: Tensor,
                            value: Tensor, attention_mask: Tensor | None,
                            **kwargs) -> tuple[Tensor, None]:
    return _packed_forward(_flash_varlen, query, key, value, attention_mask, **kwargs)


def _gpu_capability(device: torch.device) -> tuple[str, tuple[int, int]] | None:
    """(GPU name, compute capability) of a CUDA device; None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)


def _flash_installed() -> bool:
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:  # no flash_attn package at all
        return False


def _not_half(param: torch.Tensor, kernels: str) -> str:
    return (f"model.dtype is {str(param.dtype).removeprefix('torch.')}; {kernels} "
            f"bfloat16 or float16")


def flash_attn_missing(model: torch.nn.Module) -> str | None:
    """Why flash-attn-4 cannot run this model's training passes where its weights are;
    None when nothing is known to stop it (its first call is checked apart)."""
    param = next(model.parameters())
    gpu = _gpu_capability(param.device)
    if gpu is None:
        return "the policy is not on a CUDA GPU"
    name, (major, minor) = gpu
    if major not in FLASH_GPUS:
        return (f"the GPU ({name}, compute capability {major}.{minor}) is neither Hopper "
                f"(9.x) nor Blackwell (10.x)")
    if not _flash_installed():
        return "flash-attn-4 is not installed (pip install -r requirements-flash-attn.txt)"
    if param.dtype not in HALF:
        return _not_half(param, "flash-attn-4 runs")
    head_dim = attention_heads(model.config)[2]
    generation, largest = FLASH_GPUS[major]
    if head_dim % 8 or not 8 <= head_dim <= largest:
        return (f"head dim {head_dim} is not one flash-attn-4 takes on {generation} "
                f"(a multiple of 8 from 8 to {largest})")
    return None


@lru_cache(maxsize=None)
def _flash_first_call(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device) -> str | None:
    """A forward and backward at the model's head shape against per-sequence SDPA, before
    any rollout, so that a broken install stops (or, under auto, steps aside) at start
    rather than after the first rollout. It also compiles the kernels (some seconds).
    Returns what went wrong, or None."""
    g = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(1, h, 200, head_dim, generator=g, device=device, dtype=dtype)
               .requires_grad_() for h in (heads, kv_heads, kv_heads))
    lengths = (70, 130)
    try:
        with torch.enable_grad():
            out, _ = flash_attention_forward(None, q, k, v, None, scaling=head_dim**-0.5,
                                             **packing_kwargs(list(lengths), device))
            flash = [out, *torch.autograd.grad(out.float().square().sum(), (q, k, v))]
    except Exception as exc:  # noqa: BLE001  (import or CuTe DSL compile errors come in many types)
        return f"flash-attn-4 failed a first call ({type(exc).__name__}: {exc})"
    with torch.enable_grad():
        ref = _per_sequence_sdpa(q, k, v, lengths, head_dim**-0.5).transpose(1, 2)
        ref = [ref, *torch.autograd.grad(ref.float().square().sum(), (q, k, v))]
    worst = max(_relative_error(a, b) for a, b in zip(flash, ref))
    if not worst <= 2e-2:
        return f"flash-attn-4 differs from per-sequence SDPA (relative error {worst:.3g})"
    return None


def resolve_attention(model: torch.nn.Module, kind: Attention) -> tuple[str, str]:
    """(the attention the training passes run: flash_attn, varlen or sdpa; the start-up
    report's words for it). flash_attn asked for where it cannot run is a ConfigError
    naming why."""
    if kind == "sdpa":
        return "sdpa", ("transformers' SDPA attention over a block-diagonal mask "
                         "(model.attention=sdpa)")
    param = next(model.parameters())
    why = None
    if kind in ("auto", "flash_attn"):
        why = flash_attn_missing(model) or _flash_first_call(
            *attention_heads(model.config), param.dtype, param.device)
        if why is None:
            return "flash_attn", f"flash-attn-4 varlen attention (model.attention={kind})"
        if kind == "flash_attn":
            raise ConfigError(f"model.attention=flash_attn but {why}")
    words = "torch varlen flash attention"
    if not param.is_cuda:
        words, why = "per-sequence SDPA attention", "the policy is not on a CUDA GPU"
    elif param.dtype not in HALF:
        words, why = "per-sequence SDPA attention", _not_half(param, "the varlen kernels run")
    elif _varlen_fn() is None:
        words, why = "per-sequence SDPA attention", "torch's varlen kernel is unusable here"
    return "varlen", f"{words} (model.attention={kind}" + (f": {why})" if why else ")")


def use_attention(model: torch.nn.Module, kind: Attention) -> str:
    """Switch an HF model's training-pass attention (see the module's docstring); returns
    what it runs, for the start-up report and benchmarks."""
    if kind not in choices(Attention):
        raise ValueError(f"attention must be one of {', '.join(choices(Attention))}, got {kind!r}")
    chosen, words = resolve_attention(model, kind)
    if chosen != "sdpa":
        from transformers import AttentionInterface

        # Names with no mask function: transformers then builds no mask at all.
        AttentionInterface.register(NAME, varlen_attention_forward)
        AttentionInterface.register(FLASH_NAME, flash_attention_forward)
    model.set_attn_implementation({"flash_attn": FLASH_NAME, "varlen": NAME}.get(chosen, "sdpa"))
    return words
