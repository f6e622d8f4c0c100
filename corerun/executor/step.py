"""The commands rank 0 sends its workers (each step's message, the hidden rows to project, shutdown) and the last stage's reply.

A step travels as its :class:`~corerun.core.batch.ScheduledBatch` (plain values, pickled once for
every worker) together with the tokens rank 0 sampled since its last command.  Every rank applies
both to its own persistent batch (:class:`~corerun.runner.input_batch.InputBatch`) in the order
rank 0 did, so the ranks' batches stay row for row the same, and each builds its own step inputs
from it; no prepared tensor crosses between the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from corerun.core.batch import ScheduledBatch

# seq_id -> the tokens rank 0 recorded for it after sampling (InputBatch.record), in order
Recorded = Mapping[int, tuple[int, ...]]


@dataclass(slots=True)
class Step:
    """Record ``recorded``, apply ``batch`` to the persistent batch, build its inputs and run the forward.

    Under pipeline parallelism the last stage also samples (with ``eos_token_ids``), records its own
    tokens (it skips ``recorded``) and its first rank replies with the :class:`StepResult`, or with
    a :class:`StepFailed` when the step failed outside the collectives (a sampler refusing a request).
    """

    batch: ScheduledBatch
    recorded: Recorded = field(default_factory=dict)
    eos_token_ids: frozenset[int] = frozenset()


@dataclass(slots=True)
class StepFailed:
    """The last stage's reply to a step it could not finish: ``message`` is the StepError's text."""

    message: str


@dataclass(slots=True)
class Logits:
    """Project rows ``rows`` of the current step's hidden states (a slice, or increasing int64 indices)
    onto this rank's vocabulary range, for rank 0's gather."""

    rows: slice | np.ndarray


@dataclass(slots=True)
class CompareBatch:
    """Record ``recorded``, then send this rank's persistent batch (:meth:`InputBatch.snapshot`) to rank 0."""

    recorded: Recorded = field(default_factory=dict)


@dataclass(slots=True)
class Vocabulary:
    """The engine's tokenizer and end-of-sequence ids, for the logits processors of a last stage that samples."""

    tokenizer: Any
    eos_token_ids: frozenset[int]


@dataclass(slots=True)
class Timeline:
    """Send this rank's stage work intervals (``StageRunner.timeline``) to rank 0."""


@dataclass(slots=True)
class Shutdown:
    """Leave the worker loop and exit."""


Command = Step | Logits | CompareBatch | Vocabulary | Timeline | Shutdown
