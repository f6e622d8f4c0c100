"""Batch-size buckets for CUDA-graph capture: which decode batch sizes get a graph of their own.

A graph is captured for each bucket; a decode batch of ``n`` requests replays the smallest bucket
``>= n`` with the rows past ``n`` filled with padding.  Small sizes are dense (1, 2, 4, 8) because
padding a batch of 1 up to 8 would waste most of the step; above 8 the buckets step by 8, so a
batch never carries more than 7 padding rows.
"""

from __future__ import annotations

import bisect

SMALL_SIZES = (1, 2, 4, 8)
STEP = 8


def capture_sizes(max_batch_size: int) -> list[int]:
    """Bucket sizes, ascending: 1, 2, 4, 8, then multiples of 8 up to ``max_batch_size``, which is always included.

    >>> capture_sizes(20)
    [1, 2, 4, 8, 16, 20]
    >>> capture_sizes(3)
    [1, 2, 3]
    """
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"graph max_batch_size must be an integer >= 1, got {max_batch_size!r}")
    sizes = {s for s in SMALL_SIZES if s <= max_batch_size}
    sizes.update(range(STEP, max_batch_size + 1, STEP))
    sizes.add(max_batch_size)
    return sorted(sizes)


def bucket_for(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest size in ``sizes`` (ascending) that holds ``num_reqs`` requests; ``None`` when none does."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None
