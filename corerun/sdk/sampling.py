"""Sampler building blocks for plugin authors: per-request seeded generators, the exponential-race draw,
host lists to device without a sync, and the logits check.

The code lives with corerun's own samplers in :mod:`corerun.sampler.common` (read it for the seeding
scheme and why the race draws the right law); this module is its public name.
"""

from __future__ import annotations

from corerun.sampler.argmax import row_max
from corerun.sampler.common import (
    NON_FINITE,
    GeneratorCache,
    check_logits,
    exponential_race,
    mark_non_finite,
    row_seed,
    seeded_generator,
    seeded_rows,
    to_device,
)

__all__ = [
    "NON_FINITE", "GeneratorCache", "check_logits", "exponential_race", "mark_non_finite", "row_max", "row_seed",
    "seeded_generator", "seeded_rows", "to_device",
]
