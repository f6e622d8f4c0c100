"""The samplers' argmax: :func:`row_max`, ``x.max(dim=-1)`` with the same result, faster on a CPU."""

from __future__ import annotations

from typing import NamedTuple

import torch


class RowMax(NamedTuple):
    values: torch.Tensor  # [B], x's dtype
    indices: torch.Tensor  # [B] int64


ROW_MAX_CHUNK = 1024
_OFFSETS = torch.arange(ROW_MAX_CHUNK)  # a chunk's indices, made once (the chunked path runs on a CPU only)


def row_max(x: torch.Tensor) -> RowMax:
    """``x.max(dim=-1)`` for ``x`` ``[B, V]``: each row's largest value and the index of its first occurrence
    (NaN is the largest, as in torch), the same values and indices, faster on a CPU.

    torch's CPU ``max(dim)`` and ``argmax`` carry an index through their reduction and run at 2-4 GB/s
    (128 rows of 49,152 float32 logits: 6.9 and 15 ms, one thread), where ``amax`` streams (1.0 ms).  So
    on a CPU the rows are cut into chunks of :data:`ROW_MAX_CHUNK` (the last one ending at ``V``,
    overlapping the one before), ``amax`` finds each chunk's largest value, a small ``max(dim)`` the first
    chunk holding the row's, and ``max(dim)`` within that one chunk its first index.  The first chunk with
    the row's largest value holds its first occurrence, so the index is ``max(dim)``'s.  Elsewhere, for
    rows shorter than two chunks, or for a single row, it is ``x.max(dim=-1)``: one row's seven operators
    cost more than its one slow reduction inside a decode step, where every operator runs with cold caches
    after the LM head has streamed its weights (one request, bfloat16, one thread: the sampler 0.29-0.33 ms
    a step against 0.45-0.52, benchmarks/RESULTS.md "Twenty-first session"; warm, on its own, the chunks
    are the faster, 38 against 44 us).
    """
    rows, vocab = x.shape
    c = ROW_MAX_CHUNK
    if x.device.type != "cpu" or vocab < 2 * c or x.stride(-1) != 1 or rows <= 1:
        values, indices = x.max(dim=-1)
        return RowMax(values, indices)
    whole = vocab // c
    chunk_max = x[:, : whole * c].unflatten(-1, (whole, c)).amax(dim=-1)
    if vocab > whole * c:  # the last chunk [V - c, V), over the tail
        chunk_max = torch.cat([chunk_max, x[:, vocab - c :].amax(dim=-1, keepdim=True)], dim=1)
    best = chunk_max.max(dim=-1).indices
    start = torch.where(best < whole, best * c, vocab - c)
    within = x.gather(1, start[:, None] + _OFFSETS).max(dim=-1)
    return RowMax(within.values, start + within.indices)
