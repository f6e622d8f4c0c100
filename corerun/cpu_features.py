"""What the CPU can do natively, as ``corerun bench`` reports it (``machine.native_bfloat16``).

``native_bfloat16()``: the CPU has bfloat16 dot-product instructions (AVX512_BF16, or AMX's
bfloat16 tiles) and torch's oneDNN uses them.  There bfloat16 weights are multiplied at about twice
to three times the float32 rate with float32 accumulation (``dtype: bfloat16``); without them torch
emulates bfloat16 and it is slower than float32.  ``dtype: auto`` still picks float32 on CPU: why is
in docs/benchmarks.md.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The ``flags`` of the first processor in ``/proc/cpuinfo`` (empty where there is no such file)."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@lru_cache(maxsize=1)
def native_bfloat16() -> bool:
    """The CPU multiplies bfloat16 natively (AVX512_BF16 or AMX-BF16) and torch's oneDNN has that path."""
    if not BF16_FLAGS & cpu_flags():
        return False
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
