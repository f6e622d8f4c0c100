"""How many KV-cache blocks fit in the memory budget (``kv_cache.num_blocks: auto``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from corerun.errors import ConfigError

if TYPE_CHECKING:
    import torch

GiB = 1 << 30


def num_blocks_for_budget(
    bytes_per_block: int,
    *,
    device: "torch.device",
    memory_fraction: float,
    cpu_memory_gb: float,
    reserved_bytes: int = 0,
) -> int:
    """The number of blocks whose K/V tensors fit in the budget, rounded down.

    ``bytes_per_block`` is one block's size summed over all layers (K and V).  ``reserved_bytes`` is
    kept out of the budget for the caller's other needs (activations, sampler buffers).

    - CUDA: ``memory_fraction * total`` device memory, minus the memory in use now that torch cannot
      hand back for the cache: ``(total - free)`` from ``torch.cuda.mem_get_info`` (other processes,
      the CUDA context, torch's own pool) less what torch's pool holds unused
      (``memory_reserved - memory_allocated``).  Model weights must be loaded before this is called.
    - any other device (CPU): ``cpu_memory_gb`` GiB.

    Raises :class:`~corerun.errors.ConfigError` when fewer than one block fits.
    """
    if bytes_per_block < 1:
        raise ConfigError(f"bytes_per_block must be >= 1, got {bytes_per_block}")
    if not 0.0 < memory_fraction <= 1.0:
        raise ConfigError(f"kv_cache.memory_fraction must be in (0, 1], got {memory_fraction}")
    if not cpu_memory_gb > 0.0:
        raise ConfigError(f"kv_cache.cpu_memory_gb must be > 0, got {cpu_memory_gb}")
    if reserved_bytes < 0:
        raise ConfigError(f"reserved_bytes must be >= 0, got {reserved_bytes}")

    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        reusable = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        in_use = total - free - reusable
        budget = int(memory_fraction * total) - in_use - reserved_bytes
        where = (
            f"kv_cache.memory_fraction={memory_fraction} of {_fmt_bytes(total)} on {device} "
            f"= {_fmt_bytes(int(memory_fraction * total))}, {_fmt_bytes(in_use)} already in use, "
            f"{_fmt_bytes(reserved_bytes)} reserved"
        )
        fix = "raise kv_cache.memory_fraction, free device memory (smaller model or dtype), or set kv_cache.num_blocks"
        if reserved_bytes:
            fix += (
                "; the reserve is the step memory measured at startup (the 'kv_cache: step memory' log line), "
                "which lower scheduler.max_num_batched_tokens, scheduler.max_num_seqs, scheduler.max_model_len "
                "or graph.max_batch_size shrink"
            )
    else:
        budget = int(cpu_memory_gb * GiB) - reserved_bytes
        where = (
            f"kv_cache.cpu_memory_gb={cpu_memory_gb} ({_fmt_bytes(int(cpu_memory_gb * GiB))}), "
            f"{_fmt_bytes(reserved_bytes)} reserved"
        )
        fix = "raise kv_cache.cpu_memory_gb or set kv_cache.num_blocks"

    num_blocks = max(budget, 0) // bytes_per_block
    if num_blocks < 1:
        raise ConfigError(
            f"the KV cache budget holds no block: {_fmt_bytes(max(budget, 0))} left ({where}), "
            f"one block needs {bytes_per_block} bytes ({_fmt_bytes(bytes_per_block)}) over all layers; {fix}"
        )
    return num_blocks


def _fmt_bytes(n: int) -> str:
    """``n`` bytes for a message: GiB from 1 GiB up, MiB below."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / (1 << 20):.1f} MiB"
