"""A GGUF's model and tokenizer, loaded for conversion on several cores instead of one.

transformers' own GGUF path (`from_pretrained(..., gguf_file=...)`) runs on one core, and
on Qwen2.5-Coder most of its time is not the weights: for the tokenizer (twice), the
config and the weights it builds a `gguf.GGUFReader` and parses the whole metadata again
(150k tokens and merges; some 8 s a parse on a 2-core CPU, two thirds of its 104 s for
the 1.5B there), and the dequantization (18 s) comes after all of it. Here one worker
parses the metadata, once, while this process reads the tensor table and hands the
tensors to the other workers; transformers' own calls for the config and tokenizer are
then answered from that parse (`_parsed_once`). The weights are the calls transformers
makes, `gguf.quants.dequantize`, the architecture's `TensorProcessor` (llama's q/k row
order for rope) and `torch.from_numpy(...).to(dtype)`, large tensors split by rows, so
they are the same tensors bit for bit. An architecture whose processor does more than
reorder each tensor alone (the MoE ones) takes transformers' own path.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing
import os
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from minisparse.models.gguf_sources import ModelDownloadError

WORKERS_ENV = "MINISPARSE_GGUF_WORKERS"
# The 1.5B's tensors take 18 s of one core (2-core CPU), dequantized while one worker
# parses the metadata, which ends some 4 s after the tensor table is read: from about 6
# workers on they wait for that parse, so more cost memory (each imports torch) and gain
# nothing. MINISPARSE_GGUF_WORKERS asks for another number, up to the cores.
DEFAULT_WORKERS = 16
CHUNK_BYTES = 8 << 20  # a larger tensor's rows go to several workers (embedding, output)
SMALL_GGUF_BYTES = 64 << 20  # below it, a pool's start (each worker imports torch) costs more


class Job(NamedTuple):
    """One tensor, or a block of its rows, to dequantize: where its bytes lie in the file
    (a worker maps them itself: nothing large goes through a pipe to it)."""
    path: str
    name: str
    qtype: int
    offset: int
    dtype: str
    shape: tuple[int, ...]
    rows: tuple[int, int] | None  # None: the whole tensor
    out_dtype: str
    processor: Any  # None: transformers' base TensorProcessor, which changes nothing
    nbytes: int  # of the file's bytes, the rows' (the measure of a job's work)


def gguf_workers(path: Path) -> int:
    """Processes for the conversion: MINISPARSE_GGUF_WORKERS, else one (no pool) for a
    small file and DEFAULT_WORKERS for another; at most the cores this process may use."""
    asked = os.environ.get(WORKERS_ENV)
    if not asked and path.stat().st_size < SMALL_GGUF_BYTES:
        return 1
    asked = asked or str(DEFAULT_WORKERS)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if not asked.isdigit() or int(asked) < 1:
        raise ModelDownloadError(f"{WORKERS_ENV}={asked}: not a number of processes (1 or more)")
    return min(cores or 1, int(asked))


def _quiet_worker(verbose: bool) -> None:
    """A worker's own writes to stderr (library warnings; it has no redirect of its own)
    go nowhere unless verbose; its errors come back to the caller as exceptions."""
    if not verbose:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    import torch

    torch.set_num_threads(1)  # one core a worker: the pool is no wider than the cores


class _Inline(cf.Executor):
    """An executor that runs each call at once in this process (one worker: no pool)."""

    def submit(self, fn, /, *args, **kwargs) -> cf.Future:  # type: ignore[override]
        future: cf.Future = cf.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - handed to the caller by result()
            future.set_exception(exc)
        return future


@contextlib.contextmanager
def _executor(workers: int, verbose: bool) -> Iterator[cf.Executor]:
    """A spawn pool (forking a process that holds torch's threads is not safe); its
    workers start, and import torch, while this process reads the GGUF."""
    if workers <= 1:
        yield _Inline()
        return
    pool = cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                  initializer=_quiet_worker, initargs=(verbose,))
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _parse(path: str) -> dict:
    """The GGUF's metadata as transformers parses it for its config and tokenizer."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    return load_gguf_checkpoint(path, return_tensors=False)


@contextlib.contextmanager
def _parsed_once(path: Path, parsed: dict) -> Iterator[None]:
    """transformers' modules import `load_gguf_checkpoint` by name; where they hold it, a
    metadata-only call for this file is answered from `parsed` (a copy each time, by
    pickle, which copies its 300k strings in a tenth of deepcopy's time: callers change
    what they get) for the block. Any other call goes through; a module that
    imports it later misses the copy and only parses again."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401 - load the holders

    original = gguf_utils.load_gguf_checkpoint
    key = os.path.realpath(path)
    frozen = pickle.dumps(parsed, protocol=pickle.HIGHEST_PROTOCOL)

    def load(gguf_checkpoint_path, return_tensors=False, *args, **kwargs):
        if not return_tensors and os.path.realpath(gguf_checkpoint_path) == key:
            return pickle.loads(frozen)
        return original(gguf_checkpoint_path, return_tensors, *args, **kwargs)

    holders = [module for module in list(sys.modules.values())
               if getattr(module, "__dict__", {}).get("load_gguf_checkpoint") is original]
    for module in holders:
        module.load_gguf_checkpoint = load
    try:
        yield
    finally:
        for module in holders:
            module.load_gguf_checkpoint = original


def _processor(architecture: str) -> tuple[type | None, bool]:
    """(transformers' tensor processor class for the architecture, whether it changes
    tensors): its base class changes none, llama's reorders the q/k rows of each (for
    rope), one tensor at a time; any other (MoE ones keep state across tensors): None."""
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS,
                                                          LlamaTensorProcessor,
                                                          TensorProcessor)

    kind = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    if kind not in (TensorProcessor, LlamaTensorProcessor):
        return None, True
    return kind, kind is not TensorProcessor


def _jobs(reader, path: Path, processor: Any, dtype: str) -> list[Job]:
    """Every tensor as jobs, largest first (the pool's last job is then a small one); a
    tensor that no processor touches is split into blocks of rows."""
    jobs = []
    for tensor in reader.tensors:
        data = tensor.data
        job = Job(str(path), tensor.name, int(tensor.tensor_type), int(tensor.data_offset),
                  data.dtype.str, tuple(data.shape), None, dtype, processor, int(data.nbytes))
        rows = data.shape[0]
        step = max(1, CHUNK_BYTES // max(1, data.nbytes // rows))
        if processor is not None or data.ndim < 2 or step >= rows:
            jobs.append(job)
            continue
        jobs += [job._replace(rows=(start, min(start + step, rows)),
                              nbytes=(min(start + step, rows) - start) * (data.nbytes // rows))
                 for start in range(0, rows, step)]
    return sorted(jobs, key=lambda job: -job.nbytes)


def _dequantize(job: Job) -> tuple[str, tuple[int, int] | None, Any]:
    """A worker's job: the rows dequantized and converted as transformers'
    load_gguf_checkpoint does them (its processor on the whole tensor first), sent back
    as their bytes: a torch tensor would travel through /dev/shm, which a container may
    keep at 64 MB."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = np.memmap(job.path, dtype=np.dtype(job.dtype), mode="r", offset=job.offset,
                     shape=job.shape)
    if job.rows is not None:
        data = data[job.rows[0]:job.rows[1]]
    weights = dequantize(data, GGMLQuantizationType(job.qtype))
    name = job.name
    if job.processor is not None:
        result = job.processor.process(weights=weights, name=name)
        weights, name = result.weights, result.name
    tensor = torch.from_numpy(np.copy(weights)).to(getattr(torch, job.out_dtype))
    return name, job.rows, tensor.view(torch.uint8).numpy()  # bytes: a pipe, not /dev/shm


def _plain(config) -> Any:
    """The config without what transformers' GGUF path adds: a quantization_config (it
    forbids saving) and the GGUF's general.name (not where the weights came from)."""
    for key in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    return config


def _with_transformers(path: Path, dtype: str) -> tuple[Any, Any]:
    """(model, tokenizer) by transformers' own GGUF path, one core: what it builds still
    carries a quantization_config, so the weights move into a plain model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                  dtype=getattr(torch, dtype))
    model = AutoModelForCausalLM.from_config(_plain(loaded.config), dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict())
    return model, tokenizer


def _empty_model(config, dtype: str) -> Any:
    """The model for the config, its weights left uninitialized (every one is loaded),
    tied as the config says (skipping the initialization skips the tying too)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(_plain(config), dtype=getattr(torch, dtype))
    model.tie_weights()
    return model


def _rows(tensor) -> int:
    return tensor.shape[0] if tensor.dim() else 1


def _fill(model, futures: list[cf.Future], mapping: dict[str, str], dtype: str,
          path: Path) -> None:
    """Each job's rows copied into the model's weight as they come (`futures` is emptied,
    so a block is freed once in place: the peak is about one copy of the weights, not
    two); a tensor the model has no place for is left out, as transformers leaves it.
    Every weight must be filled, or be tied to one that is (lm_head to the embedding)."""
    import torch
    from tqdm.auto import tqdm

    own = model.state_dict()
    rows_filled = dict.fromkeys(own, 0)
    total = len(futures)
    done = cf.as_completed(set(futures))  # holds each until it is handed out, no longer
    futures.clear()
    for future in tqdm(done, total=total, desc="Dequantizing GGUF tensors"):
        name, rows, data = future.result()
        if name not in mapping:
            continue
        tensor = torch.from_numpy(data).view(getattr(torch, dtype))
        target = own[mapping[name]]
        target = target if rows is None else target[rows[0]:rows[1]]
        if target.shape != tensor.shape:
            raise ModelDownloadError(f"{path}: tensor {name} {rows or ''} has shape "
                                     f"{tuple(tensor.shape)}; the model's {mapping[name]} "
                                     f"wants {tuple(target.shape)}")
        target.copy_(tensor)
        rows_filled[mapping[name]] += _rows(tensor)
    whole = {own[key].data_ptr() for key, n in rows_filled.items() if n == _rows(own[key])}
    absent = [key for key in own if own[key].data_ptr() not in whole]
    if absent:
        raise ModelDownloadError(f"{path}: no tensor in the file for the model's "
                                 f"{', '.join(absent[:3])}" + (f" and {len(absent) - 3} more"
                                                               if len(absent) > 3 else ""))


def _model_and_tokenizer(path: Path, dtype: str) -> tuple[Any, Any]:
    """The model (weights not yet loaded) and tokenizer as transformers builds them from
    the GGUF's metadata (answered by _parsed_once)."""
    from transformers import AutoConfig, AutoTokenizer

    folder, name = str(path.parent), path.name
    model = _empty_model(AutoConfig.from_pretrained(folder, gguf_file=name), dtype)
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


def load_gguf(path: Path, dtype: str = "bfloat16", workers: int | None = None,
              verbose: bool = False) -> tuple[Any, Any, Any]:
    """(model in `dtype`, tokenizer, the file's GGUFReader) from a GGUF: the weights,
    tokenizer and config of transformers' `from_pretrained(..., gguf_file=...)`, the
    tensors dequantized by `workers` processes (default: gguf_workers). They start on
    the tensors as soon as this process has read the tensor table, while one worker
    parses the metadata; llama's q/k reordering needs that parse first."""
    import gguf as gguf_lib
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map, read_field

    with _executor(gguf_workers(path) if workers is None else workers, verbose) as pool:
        parsing = pool.submit(_parse, str(path))
        reader = gguf_lib.GGUFReader(path)
        kind, reorders = _processor(read_field(reader, "general.architecture")[0])
        futures = None if reorders else [pool.submit(_dequantize, job)
                                         for job in _jobs(reader, path, None, dtype)]
        parsed = parsing.result()
        with _parsed_once(path, parsed):
            if kind is None:
                return (*_with_transformers(path, dtype), reader)
            model, tokenizer = _model_and_tokenizer(path, dtype)
        processor = kind(config=parsed["config"])
        if futures is None:  # the processor needs the parsed config
            futures = [pool.submit(_dequantize, job)
                       for job in _jobs(reader, path, processor, dtype)]
        _fill(model, futures, get_gguf_hf_weights_map(model, processor), dtype, path)
    return model, tokenizer, reader
