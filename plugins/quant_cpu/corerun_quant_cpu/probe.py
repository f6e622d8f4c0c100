"""Availability probe: builds (or finds already built) the kernel library and returns every reason it cannot run."""

from __future__ import annotations


def probe() -> list[str]:
    """Reasons ``gguf_cpu`` cannot run here (no compiler or ninja, a failed build); empty when it can."""
    from corerun_quant_cpu import kernels

    return kernels.load()
