"""Availability probe: can Triton run here, and in which mode."""

from __future__ import annotations

import importlib.util
import os


def probe() -> list[str]:
    if importlib.util.find_spec("triton") is None:
        return ["triton is not installed (pip install triton)"]
    return []


def mode() -> str:
    """``"interpreter"`` on CPU (TRITON_INTERPRET=1), ``"compiled"`` on a CUDA device."""
    return "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled"
