"""Checkpoints: an HF directory that from_pretrained loads, plus everything to resume.

Layout of output_dir/checkpoints/rollout_000010/:
  hf/                  config.json, model.safetensors (the weights in model.dtype),
                       tokenizer files;
                       with LoRA (model.lora) the merged weights (W + scale * B A)
  adapter/             with LoRA only: the adapters in PEFT's format
                       (PeftModel.from_pretrained(base model, adapter/) loads them)
  ds/                  DeepSpeed state per rank: fp32 master weights, Adam moments,
                       LR scheduler (under ZeRO 1/2 without a third copy of the weights;
                       without ZeRO in float32 without the weights at all: hf/ has them)
  trainer_state.json   rollout, optimizer step, data position, non-finite step count
  rng_rank{r}.pt       python / torch (/ CUDA) RNG states of each rank (tensors and
                       tuples of ints only: read with weights_only=True)
  MANIFEST.json        every other file's size and sha256 (manifest.py)
  COMPLETE             written last; records the manifest's sha256

A checkpoint is written into .tmp_rollout_XXXXXX, every file fsynced, the marker added,
then renamed into place (atomic on one file system). A run killed mid-save leaves only
a .tmp_ directory, which resume ignores and the next start (or save) removes. Checkpoints
are deleted the same way round: renamed to .del_rollout_XXXXXX first, then removed, so a
half-deleted one is never taken for a complete one. With save_total_limit N, a save
deletes older checkpoints only after the new one is complete, and keeps N in all. A save
that fills the disk removes its .tmp_ directory and stops the run with one line
(DiskFullError): the complete checkpoints and metrics.jsonl stay as they were.

Resume trusts a checkpoint only after usable_checkpoint checked it against its manifest
(a damaged one is named and the one before it taken) and check_pickles found no file
that would run code when unpickled (refused outright: that is tampering, not damage).
Checkpoints from before manifests (COMPLETE records none, no MANIFEST.json) are taken
unverified, with a line that says so.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from minisparse.models.lora import ADAPTER_DIR, lora_enabled, save_adapter, save_merged
from minisparse.trainer.disk import disk_full_message, ran_out_of_space
from minisparse.utils.distributed import barrier, rank
from minisparse.trainer.manifest import MANIFEST, manifest_problem, write_manifest
from minisparse.trainer.safe_load import unsafe_reason
from minisparse.trainer.universal import TAG, deepspeed_state

MARKER = "COMPLETE"
NAME = re.compile(r"^rollout_(\d{6})$")
STATE = "trainer_state.json"
STALE = (".tmp_rollout_*", ".del_rollout_*")  # interrupted saves, deletes, universal copies
RECORDED_MANIFEST = re.compile(r"^manifest ([0-9a-f]{64})$", re.M)


class CheckpointError(RuntimeError):
    """A checkpoint this run cannot continue from (said before DeepSpeed touches it)."""


class DiskFullError(RuntimeError):
    """A save ran out of disk space; the message names the disk, folder and space left."""


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def _fsync_tree(path: Path) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _hf_state_dict(train_engine) -> dict[str, torch.Tensor] | None:
    """Full 16-bit weights (gathered under ZeRO 3; collective, so every rank calls it)."""
    if train_engine.zero_optimization_stage() == 3:
        return train_engine._zero3_consolidated_16bit_state_dict()
    return None  # save_pretrained reads the module's own (unsharded) weights


def _masters_hold_weights(train_engine) -> bool:
    """ZeRO 1/2 keep fp32 master weights in the optimizer state that DeepSpeed saves, and
    restore them on load; the 16-bit module weights are their rounded copy."""
    return train_engine.zero_optimization_stage() in (1, 2)


def _hf_holds_weights(train_engine) -> bool:
    """Without ZeRO in float32 (the CPU configs) the module's weights are the trained ones
    themselves, and hf/ holds them bit for bit: ds/ need not hold them again (a 135M
    model's checkpoint: 1.6 GB, not 2.2), resume reads them from hf/. Not under LoRA,
    whose hf/ holds the merged weights."""
    module = train_engine.module
    return (train_engine.zero_optimization_stage() == 0 and not lora_enabled(module)
            and all(p.dtype == torch.float32 for p in module.parameters()))


def _weights_elsewhere(train_engine) -> bool:
    """Whether ds/ leaves the module's parameters out (the masters or hf/ hold them)."""
    return _masters_hold_weights(train_engine) or _hf_holds_weights(train_engine)


def _load_hf_weights(folder: Path, module: torch.nn.Module) -> None:
    """The module's parameters from hf/'s safetensors (_hf_holds_weights); every one must
    be there (a tied LM head is its embedding)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    params = dict(module.named_parameters())
    if missing := [name for name in params if name not in state]:
        raise CheckpointError(f"{folder}: no weights for {missing[0]}"
                              + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name])


@contextmanager
def _module_weights_left_out(train_engine) -> Iterator[None]:
    """DeepSpeed writes the module's weights into ds/ next to the optimizer state: under
    ZeRO 1/2 a third copy after hf/ and the fp32 masters (2 bytes per parameter of 16),
    without ZeRO in float32 a second copy of hf/ (4 of 16). Leave parameters out of that
    file there (buffers stay); load_checkpoint rebuilds them from the masters or hf/."""
    if not _weights_elsewhere(train_engine):
        yield
        return
    names = {n for n, _ in train_engine.module.named_parameters(remove_duplicate=False)}
    full_state_dict = train_engine.module_state_dict

    def without_parameters(*args, **kwargs):
        state = full_state_dict(*args, **kwargs)
        return type(state)((k, v) for k, v in state.items() if k not in names)

    train_engine.module_state_dict = without_parameters
    try:
        yield
    finally:
        del train_engine.module_state_dict  # the class's method again


def _number(path: Path) -> int:
    return int(NAME.match(path.name).group(1))


def _checkpoints(output_dir: str | Path, complete: bool) -> list[Path]:
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if NAME.match(p.name) and (p / MARKER).is_file() == complete]
    return sorted(found, key=_number)


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints under output_dir, oldest first."""
    return _checkpoints(output_dir, complete=True)


def incomplete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Checkpoint folders without COMPLETE, oldest first: a save cut short by a version
    that wrote in place, or a checkpoint copied in part. Never resumed from."""
    return _checkpoints(output_dir, complete=False)


def remove_checkpoint(path: Path) -> None:
    """Rename out of the way (atomic), then delete: no half-deleted 'complete' checkpoint."""
    doomed = path.with_name(f".del_{path.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    _fsync_dir(path.parent)
    shutil.rmtree(doomed)


def prune_checkpoints(output_dir: str | Path, keep: int | None, newest: Path) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep` (None: keep all); `newest`,
    the one just written, always stays, even when an older run left higher numbers.
    Returns the deleted paths."""
    if keep is None:
        return []
    if keep < 1:
        raise ValueError(f"save_total_limit must be >= 1 or None, got {keep}")
    others = [p for p in reversed(complete_checkpoints(output_dir)) if p != newest]
    doomed = others[keep - 1:]
    for path in doomed:
        remove_checkpoint(path)
    return doomed


def remove_stale(output_dir: str | Path) -> list[str]:
    """Remove the folders interrupted saves and deletes left (and universal copies, named
    like them); returns their names. Only the run holding output_dir (run_lock.py) may:
    another run's save in progress looks the same."""
    root = checkpoint_root(output_dir)
    stale = sorted(p for pattern in STALE for p in root.glob(pattern))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return [p.name for p in stale]


def _write(tmp: Path, rollout: int, train_engine, tokenizer, state: dict[str, Any]) -> None:
    """Every file of the checkpoint into tmp (all ranks): DeepSpeed's state and the RNG
    per rank, then on rank 0 the HF model, trainer_state.json, MANIFEST.json and, once
    all that is on disk, COMPLETE with the manifest's sha256."""
    if rank() == 0:
        remove_stale(tmp.parent.parent)
        tmp.mkdir(parents=True)
    barrier()
    with _module_weights_left_out(train_engine):
        train_engine.save_checkpoint(str(tmp / "ds"), tag=TAG, save_latest=False)
    torch.save(rng_state(), tmp / f"rng_rank{rank()}.pt")
    state_dict = _hf_state_dict(train_engine)
    barrier()
    if rank() != 0:
        return
    if lora_enabled(train_engine.module):  # merged weights for eval.py, adapters for PEFT
        save_merged(train_engine.module, tmp / "hf")
        save_adapter(train_engine.module, tmp / ADAPTER_DIR)
    else:
        train_engine.module.save_pretrained(tmp / "hf", state_dict=state_dict)
    tokenizer.save_pretrained(tmp / "hf")
    (tmp / STATE).write_text(json.dumps(state, indent=2))
    seal(tmp, rollout)


def seal(folder: Path, rollout: int) -> None:
    """Make the written checkpoint in `folder` complete: MANIFEST.json of every file, all
    fsynced, then COMPLETE with the manifest's sha256, itself fsynced."""
    digest = write_manifest(folder)
    _fsync_tree(folder)
    (folder / MARKER).write_text(f"rollout {rollout}\nmanifest {digest}\n")
    _fsync_tree(folder)


def _publish(tmp: Path, final: Path, keep: int | None) -> None:
    """Rename the written checkpoint into place (rank 0), then prune to `keep`."""
    if final.exists():  # an older run's checkpoint of the same number
        remove_checkpoint(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    prune_checkpoints(final.parent.parent, keep, final)


def _saved(tmp: Path, final: Path, rollout: int, train_engine, tokenizer,
           state: dict[str, Any], keep: int | None) -> bool:
    """Write and publish the checkpoint; False when the disk filled up on the way."""
    try:
        _write(tmp, rollout, train_engine, tokenizer, state)
        if rank() == 0:
            _publish(tmp, final, keep)
    except Exception as exc:
        if not ran_out_of_space(exc, tmp.parent):
            raise
        return False
    return True


def save_checkpoint(
    output_dir: str | Path,
    rollout: int,
    train_engine,
    tokenizer,
    trainer_state: dict[str, Any],
    keep: int | None = None,
) -> Path:
    """Write checkpoint `rollout` atomically (all ranks call this), then delete all but
    the newest `keep` complete ones; returns its path. A full disk raises DiskFullError
    with the partial save removed, so the space it took is free again."""
    root = checkpoint_root(output_dir)
    final = root / f"rollout_{rollout:06d}"
    tmp = root / f".tmp_rollout_{rollout:06d}"
    if not _saved(tmp, final, rollout, train_engine, tokenizer, trainer_state, keep):
        # out here the failed writer's traceback is gone, its files closed: space freed
        shutil.rmtree(tmp, ignore_errors=True)
        raise DiskFullError(disk_full_message(root, final.name, latest_checkpoint(output_dir)))
    barrier()
    return final


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under output_dir, or None."""
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None


def _read_state(path: Path) -> dict[str, Any] | str:
    """trainer_state.json of checkpoint `path`, or what is wrong with it."""
    try:
        state = json.loads((path / STATE).read_text())
    except FileNotFoundError:
        return f"{STATE}: missing"
    except OSError as exc:
        return f"{STATE}: unreadable ({exc.strerror})"
    except ValueError as exc:  # not UTF-8, not JSON
        return f"{STATE}: not JSON ({exc})"
    if not isinstance(state, dict) or not isinstance(state.get("rollout"), int):
        return f"{STATE}: no rollout number"
    return state


def trainer_state(path: Path) -> dict[str, Any]:
    """trainer_state.json of checkpoint `path` (read before any model loads, and again by
    load_checkpoint). A checkpoint of another number of ranks loads too (universal.py)."""
    state = _read_state(path)
    if isinstance(state, str):
        raise CheckpointError(f"checkpoint {path}: {state}")
    return state


def _recorded_manifest(path: Path) -> str | None:
    """The manifest sha256 that COMPLETE records (None: saved before manifests)."""
    try:
        found = RECORDED_MANIFEST.search((path / MARKER).read_text(errors="replace"))
    except OSError:
        return None
    return found.group(1) if found else None


def unverified(path: Path) -> bool:
    """Saved by a version without manifests: COMPLETE records none and none is there."""
    return _recorded_manifest(path) is None and not (path / MANIFEST).exists()


def damage(path: Path, hashes: bool = True) -> str | None:
    """What makes complete checkpoint `path` unusable (the first thing found), or None:
    a file that differs from the manifest (in size; with `hashes` in sha256 too, which
    reads every byte: manifest.py gives the cost) or a trainer_state.json that does not
    parse. A checkpoint saved before manifests has only the latter checked."""
    if not unverified(path):
        if problem := manifest_problem(path, _recorded_manifest(path), hashes):
            return problem
    state = _read_state(path)
    return state if isinstance(state, str) else None


def _unfinished(path: Path) -> str:
    return f"{path.name} is incomplete (no {MARKER}: its save never finished)"


def _none_usable(output_dir: str | Path, required: bool,
                 damaged: list[tuple[Path, str]]) -> str:
    how = "--resume" if required else "resume=auto"
    if not damaged:
        unfinished = [_unfinished(p) for p in incomplete_checkpoints(output_dir)[-1:]]
        return "; ".join([f"{how}: no complete checkpoint under "
                          f"{checkpoint_root(output_dir)}", *unfinished])
    (newest, why), older = damaged[0], len(damaged) - 1
    more = f"; {older} older one{'s are' if older > 1 else ' is'} damaged too" if older else ""
    return (f"{how}: no usable checkpoint under {checkpoint_root(output_dir)}: {newest.name} "
            f"is damaged ({why}){more}; give a new output_dir to start over")


def usable_checkpoint(output_dir: str | Path, required: bool) -> Path | None:
    """The newest complete checkpoint without damage; each damaged or incomplete one after
    it is named in a line with the one taken instead. None when there is no complete
    checkpoint and none is `required` (--resume). Only damaged ones: CheckpointError,
    with --resume or without (starting over would drop the folder's metrics.jsonl rows).
    Hashes every file of the checkpoints it checks; call it on one rank."""
    damaged: list[tuple[Path, str]] = []
    for path in reversed(complete_checkpoints(output_dir)):
        problem = damage(path)
        if problem is None:
            _name_incomplete(output_dir, path, f"resuming from {path.name}")
            for bad, why in damaged:
                print(f"checkpoint {bad.name} is damaged ({why}); resuming from {path.name}",
                      flush=True)
            if unverified(path):
                print(f"checkpoint {path.name} has no {MANIFEST} (saved before manifests): "
                      f"resuming from it unverified", flush=True)
            return path
        damaged.append((path, problem))
    if damaged or required:
        raise CheckpointError(_none_usable(output_dir, required, damaged))
    _name_incomplete(output_dir, None, "starting from the first rollout")
    return None


def _name_incomplete(output_dir: str | Path, taken: Path | None, then: str) -> None:
    """A line for each checkpoint folder without COMPLETE newer than the one `taken`."""
    for path in incomplete_checkpoints(output_dir):
        if taken is None or _number(path) > _number(taken):
            print(f"checkpoint {_unfinished(path)}; {then}", flush=True)


def saved_under_zero(path: Path) -> bool | None:
    """Whether checkpoint `path`'s optimizer state is ZeRO's (1-3: a shard file per rank)
    rather than whole in the model-state file (zero_stage 0); None: ds/ holds no
    DeepSpeed state to tell by."""
    ds = path / "ds" / TAG
    if not any(ds.glob("*model_states.pt")):
        return None
    return any(ds.glob("*zero_pp_rank_*_optim_states.pt"))  # bf16_ too


def zero_mismatch(path: Path, zero_stage: int | str) -> str | None:
    """Why checkpoint `path` cannot continue under zero_stage (auto: ZeRO 1 or 2), or None:
    ZeRO's optimizer shards and the whole state saved without ZeRO do not load into each
    other (DeepSpeed would go on from the base model's weights without a word)."""
    saved, wanted = saved_under_zero(path), zero_stage != 0
    if saved is None or saved == wanted:
        return None
    how = "under ZeRO" if saved else "without ZeRO (zero_stage 0)"
    return (f"checkpoint {path.name} was saved {how} and this run has zero_stage "
            f"{zero_stage}: their optimizer states do not load into each other; resume with "
            f"--set zero_stage={'auto' if saved else 0} or give a new output_dir")


def check_pickles(path: Path, way_out: str = "resume from a checkpoint you trust or give "
                                             "a new output_dir") -> None:
    """Refuse checkpoint `path` when a file that resuming unpickles (the RNG states,
    DeepSpeed's state files) holds more than tensors and plain data (safe_load.py); the
    message ends with `way_out`."""
    for file in sorted([*path.glob("rng_rank*.pt"), *(path / "ds" / TAG).glob("*.pt")]):
        if reason := unsafe_reason(file):
            raise CheckpointError(
                f"{file}: not loaded: it holds more than tensors and plain data ({reason}) "
                f"and unpickling it could run code; {way_out}")


def load_checkpoint(path: Path, train_engine) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and this rank's RNG; returns trainer_state."""
    check_pickles(path)  # DeepSpeed unpickles its files with weights_only=False
    state = trainer_state(path)
    masters, hf = _masters_hold_weights(train_engine), _hf_holds_weights(train_engine)
    with deepspeed_state(path, state, train_engine) as ds_dir:  # resharded if need be
        load_path, _ = train_engine.load_checkpoint(
            str(ds_dir),
            tag=TAG,
            load_module_strict=not (masters or hf),  # parameters left out of ds/
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the state in {path / 'ds'}")
    if masters:  # DeepSpeed restores the fp32 masters; round them into the module
        train_engine.optimizer.update_lp_params()
    if hf:
        _load_hf_weights(path / "hf", train_engine.module)
    rng_file = path / f"rng_rank{rank()}.pt"
    if rng_file.is_file():  # absent when resuming on more ranks than were saved
        set_rng_state(torch.load(rng_file, weights_only=True))
    return state


def resume(path: Path | None, train_engine, sampler) -> tuple[int, int]:
    """(rollouts done, non-finite steps so far) once checkpoint `path` is loaded into the
    engine and the prompt sampler (data.datasets.PromptSampler); (0, 0) for a new run."""
    if path is None:
        return 0, 0
    state = load_checkpoint(path, train_engine)
    try:  # pre-flight compared seed, shuffle and the data's rows; here the rows kept
        sampler.load_state_dict(state["sampler"])
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {path.name} does not fit this run's data ({exc}); "
                              f"resume with the data, data.max_prompt_len and seed it was "
                              f"trained with, or give a new output_dir") from None
    if rank() == 0:
        print(f"resumed from {path} (rollout {state['rollout']}, step {state['step']})")
    return int(state["rollout"]), int(state.get("nonfinite_steps", 0))
