"""What the engine asks of a draft proposer, whichever kind it is (docs/speculative-decoding.md)."""

from __future__ import annotations

from typing import Any, Sequence


class Proposer:
    """A source of draft tokens for speculative decoding.

    After each step :meth:`propose` is given ``(seq_id, token_ids, k)`` for each request that decodes
    next: at most ``k`` drafts to follow ``token_ids``.  :meth:`release` forgets a request (finished,
    aborted or preempted), :meth:`reset` every request.  The defaults keep no state across steps.
    """

    num_tokens: int  # the most drafts a request gets in one step
    runner: Any = None  # the model runner it drives, if any (the engine's shutdown frees its cache)

    def propose(self, wanted: Sequence[tuple[int, Sequence[int], int]]) -> dict[int, list[int]]:
        """``seq_id -> drafts`` (at most ``k`` each) for each ``(seq_id, token_ids, k)`` of ``wanted``."""
        raise NotImplementedError

    def release(self, seq_id: int) -> None:
        """Forget request ``seq_id`` (finished, aborted or preempted)."""

    def reset(self) -> None:
        """Forget every request."""
