"""Availability probe: every reason the Triton kernels cannot run here, and the mode they would run in.

``probe()`` returns the reasons (empty when available) and logs the mode at INFO level;
``mode()`` is ``"compiled on CUDA"`` or ``"interpreter (TRITON_INTERPRET=1) on CPU"``.
Neither imports triton or changes ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import logging
import os
import sys

from corerun_attention_triton import _mode

logger = logging.getLogger("corerun_attention_triton")

MIN_TRITON = (3, 0)


def mode() -> str:
    """Where the kernels run: fixed once they are imported, else what importing them now would pick."""
    return _mode.mode()


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def probe() -> list[str]:
    reasons: list[str] = []
    if importlib.util.find_spec("triton") is None:
        reasons.append("triton is not installed (pip install 'triton>=3.0')")
    else:
        try:
            version = md.version("triton")
        except md.PackageNotFoundError:  # installed under another distribution name (e.g. pytorch-triton)
            version = None
        if version is not None and _version_tuple(version) < MIN_TRITON:
            reasons.append(f"triton {version} is too old; corerun-attention-triton needs triton >= 3.0")
    interpret = _mode.will_interpret()
    if interpret and importlib.util.find_spec("numpy") is None:
        reasons.append("Triton's interpreter (used on CPU) needs numpy (pip install numpy)")
    kernels = sys.modules.get("corerun_attention_triton.kernels")
    if interpret and getattr(kernels, "INTERPRET", True) and _mode.imported_compiled():
        reasons.append(
            f"triton was imported in compiled mode before {_mode.ENV}=1 was set (something imported triton "
            "before the kernels, e.g. transformers), so its interpreter cannot run them on this machine without "
            f"CUDA; set {_mode.ENV}=1 in the environment before starting Python"
        )
    if not interpret and not _mode.cuda_available():
        reasons.append(
            f"{_mode.ENV}={os.environ.get(_mode.ENV)!r} asks for compiled kernels, but there is no CUDA device; "
            f"unset it (or set {_mode.ENV}=1) to run in the interpreter on CPU"
        )
    if not reasons:
        logger.info("triton attention: kernels run %s", mode())
    return reasons
