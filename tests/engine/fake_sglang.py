"""A stand-in for the few SGLang 0.5.16 entry points SGLangBackend uses, installed into
sys.modules so the adapter's request building, output parsing and weight export run on a
CPU. Its Engine records every call and answers like the real one: a list of
{"output_ids", "meta_info": {"output_token_logprobs", "finish_reason"}} per request."""
from __future__ import annotations

import base64
import pickle
import os
import random
import sys
import types
from dataclasses import dataclass

import torch


@dataclass
class Meta:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
        if named_tensors is None:
            self.flat, self.meta = flattened_tensor, metadata
            return
        parts, self.meta, at = [], [], 0
        for name, t in named_tensors:
            b = t.flatten().view(torch.uint8)
            self.meta.append(Meta(name, t.shape, t.dtype, at, at + b.numel(), b.numel()))
            parts.append(b)
            at += b.numel()
        self.flat = torch.cat(parts)

    def get_flattened_tensor(self):
        return self.flat

    def get_metadata(self):
        return self.meta

    def reconstruct_tensors(self):
        return [(m.name, self.flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape))
                for m in self.meta]


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str=False):
        data = pickle.dumps(obj)
        return base64.b64encode(data).decode() if output_str else data

    @staticmethod
    def deserialize(data):
        return pickle.loads(base64.b64decode(data) if isinstance(data, str) else data)


class Engine:
    """Samples token = 10 + rng(seed) % 40 per step; stops on a stop id, else at length."""

    instances: list = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.weights = kwargs, [], {}
        self.environ = dict(os.environ)  # what the real one's subprocesses would inherit
        Engine.instances.append(self)

    def generate(self, input_ids=None, sampling_params=None, return_logprob=False, **kw):
        self.calls.append(("generate", input_ids, sampling_params, return_logprob))
        outs = []
        for ids, sp in zip(input_ids, sampling_params):
            rng = random.Random(sp["sampling_seed"] * 7919 + len(ids))
            stop = set(sp.get("stop_token_ids", ()))
            tokens, reason = [], {"type": "length", "length": sp["max_new_tokens"]}
            for _ in range(sp["max_new_tokens"]):
                tokens.append(10 + rng.randrange(40))
                if tokens[-1] in stop:
                    reason = {"type": "stop", "matched": tokens[-1]}
                    break
            pairs = [(-0.01 * t, t, None) for t in tokens]
            outs.append({"output_ids": list(tokens),
                         "meta_info": {"output_token_logprobs": pairs, "finish_reason": reason}})
        return outs

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update", load_format, flush_cache, len(named_tensors)))
        data = MultiprocessingSerializer.deserialize(named_tensors[0])
        bucket = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"],
                                       metadata=data["metadata"])
        self.weights.update({n: t.clone() for n, t in bucket.reconstruct_tensors()})
        return True, "Success"

    def flush_cache(self):
        self.calls.append(("flush",))

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release",))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume",))

    def shutdown(self):
        self.calls.append(("shutdown",))


def install(monkeypatch) -> type:
    """Put the fake package into sys.modules (undone by monkeypatch); returns Engine."""
    Engine.instances = []
    mods = {name: types.ModuleType(name) for name in (
        "sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.utils.common",
        "sglang.srt.utils.patch_torch", "sglang.srt.weight_sync",
        "sglang.srt.weight_sync.tensor_bucket")}
    mods["sglang"].Engine = Engine
    mods["sglang.srt.utils.common"].MultiprocessingSerializer = MultiprocessingSerializer
    mods["sglang.srt.utils.patch_torch"].monkey_patch_torch_reductions = lambda: None
    mods["sglang.srt.weight_sync.tensor_bucket"].FlattenedTensorBucket = FlattenedTensorBucket
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return Engine
