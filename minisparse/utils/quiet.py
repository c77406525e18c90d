"""Library chatter kept out of a run's output unless asked for (log.verbose): DeepSpeed's
accelerator and op-build lines, transformers' weight loading and shard writing bars and
its tokenizer warnings, Liger Kernel's notes on optional backends it could not import
(CuTe DSL, Ascend: it runs its Triton kernels without them). They say nothing about the run, break the rollout progress bar,
and fill a log file with carriage-return bars. Errors still show.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Iterator


def quiet_libraries(verbose: bool) -> None:
    """Called once, before DeepSpeed is imported (its accelerator choice logs on import)."""
    if verbose:
        return
    import torch
    import transformers

    if not torch.cuda.is_available():  # what DeepSpeed picks anyway, without the warning
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("liger_kernel").setLevel(logging.ERROR)


@contextlib.contextmanager
def hidden_prints(verbose: bool) -> Iterator[None]:
    """Swallows what a library print()s (DeepSpeed's "... built successfully") unless
    verbose; its logger's warnings and any exception still come through."""
    if verbose:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


@contextlib.contextmanager
def hidden_bars(verbose: bool) -> Iterator[None]:
    """Swallows what a library writes to stderr itself, past transformers' switch (the
    GGUF reader's raw tqdm bar), unless verbose; if the block fails, what it wrote is
    shown after all, since it may explain the failure."""
    if verbose:
        yield
        return
    written = io.StringIO()
    try:
        with contextlib.redirect_stderr(written):
            yield
    except BaseException:
        sys.stderr.write(written.getvalue())
        raise
