"""Token histories -> flat device positions, once per step, without a host sync (lists of numbers go
through ``corerun.sampler_utils.to_device``)."""

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
