"""Availability probe: builds (or finds already built) the kernel library and returns every reason it cannot run."""

from __future__ import annotations

from corerun_attention_cpu import kernels


def probe() -> list[str]:
    """Reasons the ``cpu`` backend cannot run here (no C++ compiler, a failed build); empty when it can."""
    _, reasons = kernels.load()
    return reasons
