"""Errors of a tensor-parallel group, and how rank 0 tells the rank that failed first from the ranks
that failed only because it did (their collectives broke)."""

from __future__ import annotations

from corerun.errors import CorerunError
from corerun.protocols.executor import Failure, RankFailedError

__all__ = ["CommunicationError", "Failure", "RankFailedError", "TensorParallelError", "is_communication_failure", "root_cause"]


class TensorParallelError(CorerunError, RuntimeError):
    """A tensor-parallel group could not start, or a rank failed while starting."""


class CommunicationError(CorerunError, RuntimeError):
    """A collective or the command channel failed: usually because another rank is gone."""


def is_communication_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a failed collective or a closed channel."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, (CommunicationError, EOFError, BrokenPipeError, ConnectionError)):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def root_cause(failures: list[Failure], settled: bool) -> Failure | None:
    """The failure to blame: an unreported exit first, then the earliest primary report; a broken
    collective only once ``settled`` (nothing better showed up in time)."""
    silent = [f for f in failures if f.primary and f.at is None]
    if silent:
        return min(silent, key=lambda f: f.rank)
    primary = [f for f in failures if f.primary]
    if primary:
        return min(primary, key=lambda f: (f.at, f.rank))
    if settled and failures:
        return min(failures, key=lambda f: (f.at or 0.0, f.rank))
    return None
