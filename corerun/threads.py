"""The ``threads`` setting: how many CPU threads torch's intra-op pool runs (matmuls, attention, sampling).

``threads: auto`` (the default) is the number of physical cores this process may run on: hyper-threads
share one core's vector units, so a second thread per core slows dense matmuls down rather than up.
Tensor-parallel ranks on one host share the cores, so ``auto`` gives each of ``world_size`` ranks its
share.  The engine applies the setting once at start (:func:`apply_threads`); the benchmark reports it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")


def physical_cores(cpuinfo: str | None = None, allowed: set[int] | None = None) -> int:
    """Physical cores among the CPUs this process may use (``os.sched_getaffinity``).

    Counted from ``/proc/cpuinfo`` as distinct ``(physical id, core id)`` pairs of the allowed
    processors; where that file or those fields are missing, the allowed CPUs themselves.
    """
    if allowed is None:
        allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return max(1, len(allowed))
    cores: set[tuple[str, str]] = set()
    for block in cpuinfo.split("\n\n"):
        fields = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        if "processor" not in fields or "core id" not in fields:
            continue
        if int(fields["processor"]) in allowed:
            cores.add((fields.get("physical id", "0"), fields["core id"]))
    return max(1, len(cores) if cores else len(allowed))


def resolve_threads(setting: int | str, world_size: int = 1) -> int:
    """The thread count for ``threads: setting`` (an integer, or ``"auto"``) in one of ``world_size`` ranks."""
    if setting == "auto":
        return max(1, physical_cores() // max(1, world_size))
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"threads must be an integer >= 1 or 'auto', got {setting!r}")
    return setting


def apply_threads(setting: int | str, world_size: int = 1) -> int:
    """Size torch's intra-op pool for ``threads: setting``; returns the thread count now in force."""
    n = resolve_threads(setting, world_size)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
