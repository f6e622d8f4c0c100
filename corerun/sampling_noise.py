"""Sampling by the exponential race, with per-request seeds (shared by every corerun sampler).

A seeded request draws its noise from a generator seeded by (seed, output position) only, so a sampler
built on these helpers gives the same tokens alone or in any batch, and two samplers built on them give
the same tokens for a request that only sets temperature and seed.

For probabilities ``p`` and independent ``q_i ~ Exp(1)``, ``argmax_i p_i / q_i`` is distributed as ``p``
(the index of the first of independent exponential clocks with rates ``p_i`` to ring).  It needs one
elementwise pass and an argmax, no ``torch.multinomial``, no cumulative sums, and no host sync.

The noise is ``Tensor.exponential_`` on accelerators; on CPU, where torch's ``exponential_`` is scalar
code (about 3x slower at 152k tokens x 64 rows), it is ``-log(U)`` with ``U ~ torch.rand``: the same
Exp(1) law, vectorised.
"""

from __future__ import annotations

from typing import Sequence

import torch

_MASK64 = (1 << 64) - 1
# Exp(1) draws of exactly 0 would turn p / q into inf (or 0/0 = nan for a masked token); clamping to the
# smallest normal float keeps every p / q finite and leaves masked tokens (p = 0) at 0.
_TINY = torch.finfo(torch.float32).tiny


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, step: int) -> int:
    """Generator seed for token ``step`` (0-based output position) of a request with ``seed``.

    A function of ``(seed, step)`` only, in ``[0, 2**63)``: the request draws the same noise alone or
    in any batch, at any row.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64)) >> 1


def exponential_race(
    probs: torch.Tensor, seeded: Sequence[tuple[int, int, int]], generator: torch.Generator
) -> torch.Tensor:
    """One token per row of ``probs`` (float32 ``[B, V]``, rows sum to 1, masked tokens 0) -> int64 ``[B]``.

    ``seeded`` lists ``(row, seed, step)``: those rows take their noise from ``generator`` (on
    ``probs.device``) reseeded with :func:`row_seed`; all other rows share one draw from torch's default
    generator.  ``probs`` is overwritten.
    """
    noise = torch.empty_like(probs)
    if len(seeded) < probs.shape[0]:
        _exponential_(noise, None)
    for row, seed, step in seeded:
        generator.manual_seed(row_seed(seed, step))
        _exponential_(noise[row], generator)
    return probs.div_(noise.clamp_min_(_TINY)).argmax(dim=-1)


def _exponential_(out: torch.Tensor, generator: torch.Generator | None) -> None:
    """Fill ``out`` (float32, contiguous) with independent Exp(1) draws."""
    if out.device.type == "cpu":
        torch.rand(out.shape, generator=generator, out=out).log_().neg_()
    else:
        out.exponential_(generator=generator)
