"""Checks of sizes against the memory there is, before anything is allocated."""

from __future__ import annotations

from pathlib import Path

import torch

from corerun.errors import ConfigError


def available_bytes(device: torch.device) -> int | None:
    """Memory that can still be allocated on ``device`` (CUDA: free device memory; CPU: the kernel's
    MemAvailable), or None when it cannot be told."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_kv_cache_fits(num_blocks: int, bytes_per_block: int, device: torch.device) -> None:
    """Refuse an explicit ``kv_cache.num_blocks`` whose cache cannot fit in what the device has left
    (instead of allocating until the process is killed)."""
    need = num_blocks * bytes_per_block
    have = available_bytes(device)
    if have is not None and need > have:
        raise ConfigError(
            f"kv_cache.num_blocks={num_blocks} needs {need / 2**30:.2f} GiB of KV cache ({bytes_per_block} bytes "
            f"per block over all layers), but {device.type} has {have / 2**30:.2f} GiB available; lower "
            f"num_blocks to at most {have // bytes_per_block}, or use num_blocks: auto"
        )
