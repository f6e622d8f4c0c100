"""The one test seam of the backend: while an ``Emulation`` is set, flash-attn is an emulator on the CPU.

Only :func:`corerun_attention_flash.testing.emulated` sets it.  While it is set the backend accepts
device ``cpu`` (and ``extra_dtypes``), skips the CUDA compute-capability check, and ``hopper`` decides
whether FA3 (``flash_attn_interface``) or FA2 (``flash_attn``) is imported; the imports themselves
find whatever ``emulated()`` put in ``sys.modules``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Emulation:
    hopper: bool
    extra_dtypes: frozenset[str] = frozenset()


_current: Emulation | None = None


def install(state: Emulation | None) -> Emulation | None:
    """Set (or clear, with ``None``) the emulation state; returns the previous one."""
    global _current
    previous, _current = _current, state
    return previous


def current() -> Emulation | None:
    return _current
