"""Backend, device and process groups of one rank: the default group over every rank of the placement,
and under pipeline parallelism each stage's tensor-parallel group."""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from corerun.config import Config
from corerun.errors import ConfigError
from corerun.distributed.errors import TensorParallelError
from corerun.distributed.group import TensorParallelGroup
from corerun.protocols.executor import Placement

logger = logging.getLogger("corerun.parallel")


def device_type(config: Config) -> str:
    """``"cuda"`` or ``"cpu"``: what ``device`` resolves to in this process."""
    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: 'cuda' was asked for, but torch.cuda.is_available() is False; use device: cpu or auto")
    return config.device


def backend_for(config: Config) -> str:
    """The collective backend: ``distributed.backend``, or for ``auto`` nccl on CUDA and gloo on CPU."""
    kind = device_type(config)
    backend = config.distributed.backend
    if backend == "auto":
        return "nccl" if kind == "cuda" else "gloo"
    if backend == "nccl" and kind != "cuda":
        raise ConfigError("distributed.backend: 'nccl' runs on CUDA devices only, but the device is cpu; use gloo (or auto)")
    return backend


def bind_device(config: Config, local_rank: int, world_size: int, is_worker: bool) -> torch.device:
    """Make ``cuda:local_rank`` this process's current device (CUDA), or size the CPU thread pool (CPU workers)."""
    if device_type(config) == "cuda":
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ConfigError(
                f"tensor-parallel rank on local device {local_rank} needs {local_rank + 1} CUDA devices on this "
                f"host, found {count}; lower tensor_parallel_size or spread the ranks over more hosts"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if is_worker:  # the ranks share this host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    return torch.device("cpu")


def ensure_not_initialized() -> None:
    """Raise when this process is already in a torch.distributed process group (one group per process)."""
    if dist.is_initialized():
        raise TensorParallelError(
            f"torch.distributed is already initialized in this process (world size {dist.get_world_size()}); "
            "corerun sets up its own tensor-parallel group, one per process: shut down the other engine "
            "(llm.engine.shutdown()) or destroy the process group first"
        )


def init_group(
    backend: str, store: dist.Store, rank: int, world_size: int, timeout_s: float, device: torch.device
) -> TensorParallelGroup:
    """Join the default torch.distributed process group through ``store``; returns this rank's group."""
    ensure_not_initialized()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return TensorParallelGroup(rank, world_size, device)


def destroy_group() -> None:
    """Leave the default process group, if this process is in one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def stage_group(placement: Placement, rank: int, device: torch.device) -> TensorParallelGroup | None:
    """Rank ``rank``'s tensor-parallel group inside its pipeline stage (``None`` when a stage is one rank).

    Every rank creates every stage's group, in stage order (torch.distributed's rule for ``new_group``);
    the last stage's group gathers the logits to all of its ranks, which all sample.
    """
    tp, mine = placement.tensor_parallel_size, None
    if tp == 1:
        return None
    for stage in range(placement.pipeline_parallel_size):
        group = dist.new_group(placement.ranks_of_stage(stage))
        if stage == placement.stage_of(rank):
            last = stage == placement.pipeline_parallel_size - 1 and placement.pipeline_parallel_size > 1
            mine = TensorParallelGroup(placement.tp_rank_of(rank), tp, device, group, gather_to_all=last)
    return mine
