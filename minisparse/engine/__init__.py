"""Rollout engine: paged KV pool, continuous-batching scheduler, model runner over the
policy's own weights, sampler, and KV-cache eviction for sparse rollouts; make_backend
picks it or the embedded SGLang engine (dense only)."""
from minisparse.engine.backend import RolloutBackend, check_backend, make_backend
from minisparse.engine.config import SamplingParams
from minisparse.engine.engine import LLMEngine
from minisparse.engine.sequence import GenerateStats, SampleOutput

__all__ = ["GenerateStats", "LLMEngine", "RolloutBackend", "SampleOutput",
           "SamplingParams", "check_backend", "make_backend"]
