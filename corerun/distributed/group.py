"""The collectives the parallel layers call, over the process group of this tensor-parallel rank.

The layers see only ``rank``, ``world_size``, ``all_reduce`` and ``gather_last_dim`` (anything with
those works, as the tests' single-process stand-in shows); the driver and workers also use
``gather_object`` (comparing the ranks' persistent batches), every rank's ModelRunner ``min_int``
(the KV cache's block count), and pipeline stages ``send`` / ``recv`` (a stage's hidden states).  A failed collective raises :class:`CommunicationError`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from corerun.distributed.errors import CommunicationError


def _collective(name: str, op: Callable[[], Any]) -> Any:
    try:
        return op()
    except RuntimeError as exc:  # gloo / NCCL report a lost peer, a timeout, an aborted communicator
        raise CommunicationError(f"{name} failed: {exc}") from exc


class TensorParallelGroup:
    """Rank ``rank`` of ``world_size``; collectives run on ``group`` (``None``: torch.distributed's default group).

    ``device`` is where this rank's tensors live (NCCL reduces CUDA tensors, gloo CPU tensors).
    ``gather_to_all``: ``gather_last_dim`` gives every rank the whole result (a pipeline's last stage,
    where every rank samples), not rank 0 alone.
    """

    def __init__(
        self, rank: int, world_size: int, device: torch.device, group: dist.ProcessGroup | None = None,
        gather_to_all: bool = False,
    ) -> None:
        self.rank, self.world_size, self.device, self.group = rank, world_size, device, group
        self.gather_to_all = gather_to_all

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        _collective("all_reduce", lambda: dist.all_reduce(x, group=self.group))
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 (every rank with ``gather_to_all``): every rank's ``x`` ``[..., k]`` concatenated along the
        last dimension ``[..., world_size * k]``; other ranks: ``None`` (they only send)."""
        x = x.contiguous()
        if self.gather_to_all:
            every = [torch.empty_like(x) for _ in range(self.world_size)]
            _collective("all_gather", lambda: dist.all_gather(every, x, group=self.group))
            return torch.cat(every, dim=-1)
        if self.rank != 0:
            _collective("gather", lambda: dist.gather(x, None, group=self.group, group_dst=0))
            return None
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        _collective("gather", lambda: dist.gather(x, parts, group=self.group, group_dst=0))
        return torch.cat(parts, dim=-1)

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Rank 0: every rank's picklable ``obj``, in rank order; other ranks: ``None`` (they only send)."""
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        _collective("gather_object", lambda: dist.gather_object(obj, out, group=self.group, group_dst=0))
        return out

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send ``x`` to rank ``dst`` of the default group (a pipeline stage's output to the next stage)."""
        _collective("send", lambda: dist.send(x.contiguous(), dst))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        """A ``shape`` ``dtype`` tensor from rank ``src`` of the default group."""
        x = torch.empty(shape, dtype=dtype, device=self.device)
        _collective("recv", lambda: dist.recv(x, src))
        return x

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        _collective("all_reduce", lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group))
        return int(t.item())
