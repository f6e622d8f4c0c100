"""Where the Triton kernels run: compiled for a CUDA device, or in Triton's interpreter on CPU.

Triton decides between the two when ``@triton.jit`` decorates a kernel, from the environment
variable ``TRITON_INTERPRET``.  :func:`ensure_mode` therefore runs before any kernel module of
this package is imported (``corerun_attention_triton.kernels`` calls it first): on a machine
without CUDA, where compiled kernels could not run at all, it sets ``TRITON_INTERPRET=1`` unless
the user set the variable themselves.  A value the user set is always respected.

Nothing here imports triton; torch is imported only to ask whether CUDA is available.
"""

from __future__ import annotations

import os
import sys

ENV = "TRITON_INTERPRET"
COMPILED = "compiled on CUDA"
INTERPRETED = "interpreter (TRITON_INTERPRET=1) on CPU"
_TRUE = frozenset({"1", "true", "on", "yes", "y"})  # the spellings triton itself reads as true


def env_flag() -> bool | None:
    """``TRITON_INTERPRET`` read as triton reads it, or ``None`` when it is not set."""
    value = os.environ.get(ENV)
    if value is None:
        return None
    return value.strip().lower() in _TRUE


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def will_interpret() -> bool:
    """Whether kernels imported now would run in the interpreter (without changing anything)."""
    flag = env_flag()
    return (not cuda_available()) if flag is None else flag


def mode() -> str:
    """``"compiled on CUDA"`` or ``"interpreter (TRITON_INTERPRET=1) on CPU"``.

    Once the kernels are imported their mode is fixed, whatever the environment says later.
    """
    kernels = sys.modules.get("corerun_attention_triton.kernels")
    interpret = getattr(kernels, "INTERPRET", None)
    if interpret is None:
        interpret = will_interpret()
    return INTERPRETED if interpret else COMPILED


def ensure_mode() -> bool:
    """Set ``TRITON_INTERPRET=1`` when it is unset and there is no CUDA device; return whether kernels interpret."""
    if env_flag() is None and not cuda_available():
        os.environ[ENV] = "1"
    return bool(env_flag())


def imported_compiled() -> bool:
    """Whether triton itself was imported in compiled mode: its own ``@triton.jit`` helpers (``tl.max``,
    ``tl.sum``, ...) are then compiled-mode functions, which an interpreted kernel cannot call."""
    standard = sys.modules.get("triton.language.standard")
    helper = getattr(standard, "max", None)
    return helper is not None and type(helper).__name__ != "InterpretedFunction"

