"""What the engine asks of a draft proposer, whichever kind it is (docs/speculative-decoding.md)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from corerun.core.sequence import Sequence


class Proposer:
    """A source of draft tokens for the engine's speculative decoding.

    Each step the engine calls :meth:`prepare` before scheduling, then :meth:`draft` for each request
    the scheduler decodes; :meth:`release` when a request ends or is preempted, :meth:`reset` to
    forget every request.  The defaults do nothing, for a proposer that keeps no state across steps.
    """

    num_tokens: int  # the most drafts a request gets in one step
    runner: Any = None  # the model runner it drives, if any (the engine's shutdown frees its cache)

    def prepare(self, seqs: Iterable[Sequence], room: Callable[[Sequence, int], int]) -> None:
        """Before the step is scheduled: ``seqs`` are the running requests, ``room(seq, k)`` how many
        of ``k`` drafts ``seq`` may carry this step."""

    def draft(self, seq: Sequence, at_most: int) -> list[int]:
        """Draft tokens to follow ``seq``'s tokens, at most ``at_most`` of them."""
        raise NotImplementedError

    def release(self, seq_id: int) -> None:
        """Forget request ``seq_id`` (finished, aborted or preempted)."""

    def reset(self) -> None:
        """Forget every request."""
