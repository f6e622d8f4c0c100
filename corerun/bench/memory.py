"""Peak memory of a measured section: CUDA's allocator high-water mark, or the process's peak RSS on CPU.

On CPU the peak resident set size is a process-wide high-water mark (``getrusage``'s ``ru_maxrss``).
Linux lets a process reset it (``5`` written to ``/proc/self/clear_refs``); where that works each
section's peak is its own, otherwise it also covers whatever ran before in the process, and
``reset`` says so.
"""

from __future__ import annotations

import gc
import resource
import sys
from dataclasses import dataclass

import torch


@dataclass
class PeakMemory:
    bytes: int
    kind: str  # "cuda_max_memory_allocated" | "peak_rss"
    reset: bool  # the high-water mark was reset before the section (else it includes earlier work)

    def to_dict(self) -> dict[str, object]:
        return {"bytes": self.bytes, "kind": self.kind, "reset": self.reset}


class PeakMemoryMeter:
    """``start()`` before the section, ``read()`` after: the peak memory in between."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._reset = False

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._reset = True
        else:
            self._reset = _reset_peak_rss()

    def read(self, reset_away: int = 0) -> PeakMemory:
        """``reset_away``: a high-water mark the section reset meanwhile (the engine's startup profile
        resets it to measure its steps: ``StepMemory.high_water_bytes``)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = max(torch.cuda.max_memory_allocated(self.device), reset_away)
            return PeakMemory(int(peak), "cuda_max_memory_allocated", self._reset)
        return PeakMemory(peak_rss_bytes(), "peak_rss", self._reset)


def peak_rss_bytes() -> int:
    """The process's peak resident set size in bytes (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
