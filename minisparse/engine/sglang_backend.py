"""SGLangBackend: the RolloutBackend over an embedded `sglang.Engine` (dense rollouts only).

SGLang is the speed reference and the engine most RL frameworks embed. It is driven here
exactly like the native engine: token ids in, token ids and the sampled tokens' log-probs
out, memory released for the update phase and resumed for the rollout, weights pushed
from the policy's own tensors (CUDA IPC, no disk). The engine starts on a config-only
model directory with load_format="dummy": the first update_weights() loads the real
weights, so checkpoints, named shapes and the tiny model all work the same way.

Pinned to SGLang 0.5.16 (torch 2.11); see requirements-gpu.txt. Processes that create it
must guard their entry point with `if __name__ == "__main__":` (SGLang spawns workers).
"""
from __future__ import annotations

import contextlib
import os
import random
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from minisparse.config.schema import CompressConfig, ConfigError, EngineConfig
from minisparse.engine.config import SamplingParams
from minisparse.engine.engine import eos_token_ids
from minisparse.engine.layers.sampler import seed_for
from minisparse.models.loading import kv_bytes_per_token
from minisparse.engine.sequence import GenerateStats, SampleOutput
from minisparse.models.loading import attention_heads

BUCKET_BYTES = 512 * 2**20  # weights go over in flattened buckets of about this size
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def weight_buckets(model: nn.Module, dtype: torch.dtype,
                   bucket_bytes: int = BUCKET_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The policy's parameters under their HF names, cast to `dtype`, grouped in lists of
    at most bucket_bytes (a larger tensor gets a bucket of its own). Tied weights appear
    once (named_parameters de-duplicates); SGLang's loader re-ties lm_head itself."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, param in model.named_parameters():
        tensor = param.detach().to(dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def write_model_dir(model: nn.Module, dtype: str) -> tempfile.TemporaryDirectory:
    """A temp HF directory holding only the model's config (and generation config): what
    SGLang needs to build the architecture before the weights arrive over IPC. Removed by
    its cleanup() (SGLangBackend.shutdown), when dropped, or at the latest at exit."""
    model_dir = tempfile.TemporaryDirectory(prefix="minisparse-sglang-")
    path = model_dir.name
    config = model.config
    if not getattr(config, "architectures", None):
        config.architectures = [type(model).__name__]
    config.save_pretrained(path)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    return model_dir


def memory_fraction(kv_fraction: float, weight_bytes: int, free_bytes: int) -> float:
    """SGLang's mem_fraction_static for a KV pool of kv_fraction of the memory left free
    after the weights load (the native engine's meaning of kv_memory_fraction). SGLang's
    pool is free_after_weights - free_before * (1 - f); solving for f gives this."""
    w = min(weight_bytes / max(free_bytes, 1), 1.0)
    return min(kv_fraction + w - kv_fraction * w, 0.99)


def token_budget(config: Any, cfg: EngineConfig, dtype: torch.dtype) -> int:
    """SGLang's max_total_tokens: kv_memory_gb's worth of tokens where set, and never more
    than max_num_seqs full-length sequences. Without that cap a small model's pool spans
    hundreds of millions of tokens (0.8 of an H200 at a few hundred bytes each), and
    SGLang's flush_cache re-allocates an int64 slot per token (3.45 GiB for the tiny config,
    which ran the GPU out of memory at the first weight push)."""
    cap = cfg.max_num_seqs * cfg.context_len(config.max_position_embeddings)
    if cfg.kv_memory_gb > 0:
        return min(cap, int(cfg.kv_memory_gb * 2**30 // kv_bytes_per_token(config, dtype)))
    return cap


def request_params(params: SamplingParams, stop_ids: set[int], seed: int) -> dict:
    """One request's SGLang sampling dict: the native stop set (eos + end-of-turn markers
    + params.stop_token_ids) and a per-sample seed (used in deterministic mode)."""
    if params.ignore_eos and params.stop_token_ids:
        raise ValueError("SGLang ignores stop_token_ids when ignore_eos is set; drop one")
    out = dict(max_new_tokens=params.max_new_tokens, temperature=params.temperature,
               top_p=params.top_p, top_k=params.top_k, ignore_eos=params.ignore_eos,
               sampling_seed=seed, skip_special_tokens=False, no_stop_trim=True)
    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else stop_ids)
    if stop:
        out["stop_token_ids"] = sorted(stop)
    return out


def parse_output(out: dict, prompt_index: int, sample_index: int,
                 prompt: list[int]) -> SampleOutput:
    """SampleOutput from one SGLang result: tokens and log-probs both come from
    meta_info.output_token_logprobs ((logprob, token_id, text) per sampled token), so the
    two always line up; the stop token is kept, as in the native engine."""
    meta = out["meta_info"]
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise RuntimeError("SGLang returned no output_token_logprobs (return_logprob off?)")
    token_ids = [int(p[1]) for p in pairs]
    if "output_ids" in out and list(out["output_ids"])[: len(token_ids)] != token_ids:
        raise RuntimeError("SGLang output_ids disagree with output_token_logprobs")
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    return SampleOutput(prompt_index, sample_index, list(prompt), token_ids,
                        [float(p[0]) for p in pairs], FINISH_REASONS.get(kind, "abort"))


# Set by torchrun for the training process. SGLang's subprocesses inherit the environment;
# with TORCHELASTIC_USE_AGENT_STORE set, their own init_process_group waits forever for a
# torchrun agent store at SGLang's port (seen on an H200: train.py hung at engine start).
LAUNCHER_ENV = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def launcher_env_hidden() -> Iterator[None]:
    """Start SGLang's processes as if outside torchrun; the environment comes back after."""
    saved = {k: os.environ.pop(k) for k in LAUNCHER_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


class SGLangMissingError(ImportError, ConfigError):
    """engine.backend=sglang on an install without SGLang (a config the machine can't run)."""


def require_sglang() -> Any:
    """The sglang module, imported only here: CPU installs (and CI) have no SGLang."""
    try:
        import sglang
    except ImportError as exc:
        raise SGLangMissingError("engine.backend=sglang needs SGLang 0.5.16 (requirements-gpu"
                                 ".txt: MINISPARSE_GPU=1 bash install.sh)") from exc
    return sglang


class SGLangBackend:
    """One sglang.Engine on this process's GPU, colocated with the trainer."""

    def __init__(self, model: nn.Module, tokenizer: Any, cfg: EngineConfig,
                 compress: CompressConfig | None, device: torch.device | str, dtype: str,
                 seed: int = 0, deterministic: bool = False, **overrides: Any) -> None:
        sglang = require_sglang()
        if compress is not None and compress.algorithm != "none":
            raise ValueError("the SGLang backend is dense only: SGLang cannot free evicted "
                             "tokens; use the native engine for compressed rollouts")
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"the SGLang backend needs a CUDA device, got {device}")
        self.dtype = getattr(torch, dtype)
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.last_stats = GenerateStats()
        self.awake = True
        self.bucket_bytes = BUCKET_BYTES
        kwargs = self.engine_kwargs(model, cfg, dtype, seed, device, deterministic)
        with launcher_env_hidden():
            self.engine = sglang.Engine(**kwargs | overrides)

    def engine_kwargs(self, model: nn.Module, cfg: EngineConfig, dtype: str, seed: int,
                      device: torch.device, deterministic: bool) -> dict:
        """sglang.Engine arguments from our engine settings (see docs/engine.md)."""
        gpu = device.index if device.index is not None else torch.cuda.current_device()
        weight_bytes = sum(p.numel() for p in model.parameters()) * self.dtype.itemsize
        free, _ = torch.cuda.mem_get_info(gpu)
        self.model_dir = write_model_dir(model, dtype)
        kwargs = dict(
            model_path=self.model_dir.name, skip_tokenizer_init=True,
            load_format="dummy", dtype=dtype, base_gpu_id=gpu, tp_size=1,
            port=30000 + 17 * gpu, random_seed=seed, enable_memory_saver=True,
            attention_backend=attention_backend(model.config), sampling_backend="pytorch", grammar_backend="none",
            mem_fraction_static=memory_fraction(cfg.kv_memory_fraction, weight_bytes, free),
            max_running_requests=cfg.max_num_seqs,
            max_prefill_tokens=cfg.max_prefill_tokens,
            disable_cuda_graph=not cfg.cuda_graphs,
            enable_deterministic_inference=deterministic, log_level="error")
        kwargs["max_total_tokens"] = token_budget(model.config, cfg, self.dtype)
        return kwargs

    # ---- phase control ------------------------------------------------------------------

    def dense(self) -> contextlib.AbstractContextManager[None]:
        """Its cache is always dense."""
        return contextlib.nullcontext()

    def sleep(self) -> None:
        """Weights, KV cache and CUDA graphs off the GPU (torch_memory_saver)."""
        if self.awake:
            self.engine.release_memory_occupation()
            self.awake = False

    def wake(self) -> None:
        if not self.awake:
            self.engine.resume_memory_occupation()
            self.awake = True

    def update_weights(self, model: nn.Module) -> None:
        """Push `model`'s parameters (full tensors: under ZeRO-3 call inside a gather) to
        the engine in flattened buckets over CUDA IPC, one bucket alive at a time; then the
        prefix cache is flushed, since its KV was computed with the old weights."""
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        if not self.awake:
            raise RuntimeError("SGLang engine is asleep: call wake() before update_weights()")
        monkey_patch_torch_reductions()
        for named in weight_buckets(model, self.dtype, self.bucket_bytes):
            bucket = FlattenedTensorBucket(named_tensors=named)
            payload = MultiprocessingSerializer.serialize(
                {"flattened_tensor": bucket.get_flattened_tensor(),
                 "metadata": bucket.get_metadata()}, output_str=True)
            self.engine.update_weights_from_tensor(
                named_tensors=[payload], load_format="flattened_bucket", flush_cache=False)
        self.engine.flush_cache()

    # ---- generation ---------------------------------------------------------------------

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 progress: bool = False) -> list[SampleOutput]:
        """params.n samples per prompt, prompt-major, each its own request and seed (the
        native engine's seed_for(base, seed_offset + index)); SGLang's prefix cache shares
        the prompt."""
        if not self.awake:
            raise RuntimeError("SGLang engine is asleep: call wake() before generate()")
        base_seed = params.seed if params.seed is not None else random.getrandbits(32)
        prompts, sampling, where = [], [], []
        for p, prompt in enumerate(prompt_token_ids):
            for j in range(params.n):
                index = params.seed_offset + p * params.n + j
                prompts.append(list(prompt))
                sampling.append(request_params(params, self.eos_ids, seed_for(base_seed, index)))
                where.append((p, j))
        start = time.perf_counter()
        outs = self.engine.generate(input_ids=prompts, sampling_params=sampling,
                                    return_logprob=True)
        wall = time.perf_counter() - start
        results = [parse_output(o, p, j, prompt_token_ids[p]) for o, (p, j) in zip(outs, where)]
        tokens = sum(len(r.token_ids) for r in results)
        self.last_stats = GenerateStats(generated_tokens=tokens, wall_s=wall,
                                        tokens_per_s=tokens / max(wall, 1e-9),
                                        prefill_tokens=sum(map(len, prompts)))
        return results

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.model_dir.cleanup()


def attention_backend(config: Any) -> str:
    """fa3 (FlashAttention 3, the fastest on Hopper) for the real models' head sizes;
    triton for the tiny test model's 16-wide heads, which FA3 has no kernel for."""
    return "fa3" if attention_heads(config)[2] in (64, 128, 256) else "triton"
