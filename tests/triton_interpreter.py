"""Import our Triton kernel modules so that their kernels run in Triton's interpreter on CPU tensors.

`@triton.jit` picks the interpreter when the decorated module is imported, so TRITON_INTERPRET=1 is set
here before any kernel module is imported; if another test module imported one earlier without the
variable, `interpreted` re-executes it (``importlib.reload``: same module object, new kernel objects).
That is enough because the kernels call only tl builtins and our own @jit helpers: triton's own @jit
helpers (tl.cdiv, tl.zeros, ...) stay compiled-mode objects when triton was imported first, and the
interpreter cannot call those.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import importlib
from types import ModuleType

import numpy as np
from triton.runtime.jit import JITFunction


def _fix_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter calls ``int()`` on 1-element arrays for loop bounds, which numpy >= 2.4
    rejects (triton-lang/triton#9171, fixed upstream by #9172): convert through a 0-d view instead."""
    try:
        int(np.zeros(1))  # type: ignore[call-overload]
        return
    except TypeError:
        pass
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "numpy_2_4_fix", False):
        return

    def patched(tensor: object, scope: interpreter._LangPatchScope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    patched.numpy_2_4_fix = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def interpreted(name: str) -> ModuleType:
    """The kernel module ``name`` with interpreted kernels (its kernel-module imports too: `gemm`, then
    `flag_kernels`)."""
    _fix_interpreter_for_numpy_2_4()
    gemm = importlib.import_module("overlap_runtime.gemm")
    if not gemm.INTERPRETED:  # imported earlier in this process without TRITON_INTERPRET=1
        gemm = importlib.reload(gemm)
    assert gemm.INTERPRETED
    flag_kernels = importlib.import_module("overlap_runtime.flag_kernels")
    if _compiled(flag_kernels):
        importlib.reload(flag_kernels)
    module = importlib.import_module(name)
    return importlib.reload(module) if _compiled(module) else module


def _compiled(module: ModuleType) -> bool:
    """Whether ``module`` was imported before TRITON_INTERPRET was set: its kernels are compiled-mode objects."""
    return any(isinstance(v, JITFunction) for v in vars(module).values())
