"""Latency statistics: percentiles, and per-request time to first token / time per output token.

Percentiles interpolate linearly between order statistics (numpy's default, Hyndman & Fan type 7):
the ``q``-th percentile of sorted ``x[0..n-1]`` sits at rank ``q / 100 * (n - 1)``.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

QUANTILES = {"median": 50.0, "p90": 90.0, "p99": 99.0}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0 <= q <= 100) of ``values`` with linear interpolation; NaN when empty."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"a percentile is between 0 and 100, got {q}")
    xs = sorted(float(v) for v in values)
    if not xs:
        return math.nan
    rank = q / 100.0 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """``{"median", "p90", "p99"}`` of ``values`` (None each when there are none)."""
    if not values:
        return {k: None for k in QUANTILES}
    return {k: percentile(values, q) for k, q in QUANTILES.items()}


def request_latencies(metrics: Iterable[Mapping[str, float]], num_output: Iterable[int]) -> tuple[list[float], list[float]]:
    """Per-request time to first token and time per output token, in seconds.

    ``metrics`` holds ``arrival_time``, ``first_token_time`` and ``finish_time`` (one clock);
    TTFT is ``first_token_time - arrival_time``; TPOT is ``(finish_time - first_token_time) / (n_out - 1)``,
    defined only for requests with at least two output tokens (others are left out of the TPOT list).
    """
    ttft, tpot = [], []
    for m, n in zip(metrics, num_output):
        first = m.get("first_token_time")
        if first is None:
            continue
        ttft.append(first - m["arrival_time"])
        if n >= 2 and m.get("finish_time") is not None:
            tpot.append((m["finish_time"] - first) / (n - 1))
    return ttft, tpot
