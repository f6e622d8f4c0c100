"""The Triton kernels, one per module, each with its launch wrapper beside it.

Importing this package first settles interpreter-or-compiled mode (see ``corerun_attention_triton._mode``):
``@triton.jit`` reads ``TRITON_INTERPRET`` when the kernel modules below are imported.
"""

from __future__ import annotations

from corerun_attention_triton._mode import ensure_mode

ensure_mode()

import triton  # noqa: E402  (must follow ensure_mode)

INTERPRET: bool = bool(triton.knobs.runtime.interpret)
"""True when these kernels run in Triton's interpreter (fixed for the life of the process)."""

__all__ = ["INTERPRET"]
