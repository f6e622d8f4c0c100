"""Token lists and index ranges -> device tensors, without a host sync (lists of numbers go through
``corerun.sampler.common.to_device``)."""

from __future__ import annotations

from itertools import chain
from typing import Sequence

import torch


def move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor -> ``device`` (pinned, non-blocking on CUDA)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def flat_positions(
    rows: Sequence[int], seqs: Sequence[Sequence[int]], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists of some rows -> (``row * vocab_size + token`` int64 ``[H]``, their row int64 ``[H]``), on CPU.

    ``rows[j]`` owns ``seqs[j]`` (a row may appear more than once); ``H`` is the total length.  Built
    with one flattening and ``repeat_interleave``, no per-token Python.
    """
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    tokens = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.int64)
    row_ids = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.int64), lengths)
    return row_ids * vocab_size + tokens, row_ids


def ranges(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenated index ranges ``[starts[s], starts[s] + lengths[s])`` built on the tensors' device.

    ``starts``, ``lengths`` int64 ``[S]``; ``total`` (known on the host) is ``lengths.sum()``, given so that
    nothing waits on the device.  Returns (the indices int64 ``[total]``, the range each belongs to
    int64 ``[total]``).
    """
    seg = torch.repeat_interleave(torch.arange(starts.numel(), device=starts.device), lengths, output_size=total)
    first = lengths.cumsum(0) - lengths  # where each range begins in the output
    return torch.arange(total, device=starts.device) + (starts - first).index_select(0, seg), seg
