"""Run a module's Triton kernels through Triton's CPU interpreter, for machines without
CUDA (shared by the compression and engine kernel tests)."""
from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType


def patch_interpreter_for_numpy2() -> None:
    """Triton 3.6's interpreter turns a scalar tensor (a 1-element array) into a Python int
    with int(array), which NumPy >= 2.4 rejects; runtime loop bounds (range(start, end))
    hit it. Re-register __index__ through the same patch scope, reading the one element."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_minisparse_patched", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._minisparse_patched = True


def import_interpreted(module: str) -> ModuleType:
    """Import `module` with its kernels (and Triton's own @jit library: tl.max, tl.sum...)
    run by the interpreter. Triton picks interpreter or compiler per function when it is
    decorated, and on CPU test runs something (transformers) usually imported Triton first,
    so its Python modules are imported afresh (the compiled extension triton._C is kept)."""
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.max, InterpretedFunction):
        stale = [m for m in sys.modules if m == "triton" or m.startswith("triton.")]
        for name in stale:
            if not name.startswith("triton._C"):
                del sys.modules[name]
    sys.modules.pop(module, None)
    patch_interpreter_for_numpy2()
    return importlib.import_module(module)
