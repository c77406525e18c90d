"""Loading a checkpoint runs none of its code.

torch.load(weights_only=False), which DeepSpeed uses for its state files, unpickles
whatever the file names: a file whose pickle calls os.system runs it on resume (and a
plain rerun resumes by default). So every pickled file a resume reads is first loaded
with weights_only=True, which builds only tensors, Python containers and numbers, and
the few classes allow-listed below; a file that needs anything else is refused unloaded.

ALLOWED holds what DeepSpeed's own state files contain under ZeRO 0-3 with fp32, bf16
and fp16 (found by saving tiny checkpoints and listing what weights_only rejected): the
loss scaler and its dynamic variant, the ZeRO stage enum and the address record of a
flat parameter fragment. Each is plain data: rebuilt by setting attributes (no
__setstate__ or __reduce__ of its own), or by Enum's value lookup.

The check memory-maps the file's tensors instead of reading them, so it costs the
pickle's parse (milliseconds), not the file's size.
"""
from __future__ import annotations

import re
import zipfile
from pathlib import Path

import torch


def allowed_classes() -> list[type]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


# The paragraphs of torch's refusal that are not the reason: its advice to load the file
# with weights_only=False (which would run the code this check keeps from running), its
# request to file an issue, and its pointer to the documentation.
TORCH_ADVICE = re.compile(r"Weights only load failed\.|In PyTorch 2\.6, .*? trusted source\.|"
                          r"Please file an issue .*?WeightsUnpickler error:|"
                          r"Check the documentation of torch\.load .*", re.S)


def _reason(exc: Exception) -> str:
    """The part of torch's several-paragraph refusal that names what was refused, without
    its advice to load the file unsafely."""
    text = str(exc)
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(?: was not an allowed global|\n|$)",
                      text)
    if found:
        return found.group(1).strip()
    lines = [line.strip() for line in TORCH_ADVICE.sub("", text).splitlines() if line.strip()]
    return lines[0].rstrip(".") if lines else type(exc).__name__


def unsafe_reason(file: Path) -> str | None:
    """Why `file` does not load as plain data (None: it does)."""
    try:
        with torch.serialization.safe_globals(allowed_classes()):
            torch.load(file, map_location="cpu", weights_only=True,
                       mmap=zipfile.is_zipfile(file))
    except Exception as exc:  # any refusal or parse failure: never fall back to pickle
        return _reason(exc)
    return None

