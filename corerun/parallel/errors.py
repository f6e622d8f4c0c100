"""Errors of a tensor-parallel group; each names the rank that failed."""

from __future__ import annotations

from corerun.errors import CorerunError, StepError


class TensorParallelError(CorerunError, RuntimeError):
    """A tensor-parallel group could not start, or a rank failed while starting."""


class RankFailedError(StepError):
    """A rank failed during a step; the group is down and every later step fails with the same message.

    ``rank`` is the rank that failed (``None`` when no rank could be named).
    """

    def __init__(self, rank: int | None, message: str) -> None:
        self.rank = rank
        super().__init__(message)
