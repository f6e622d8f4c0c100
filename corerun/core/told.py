"""What the runner has been told of each request (protocol version 3), and the messages that tell it.

Per request holding blocks: its block table's length as reported and the changes not yet handed out
(its request not scheduled since); per request the runner holds: how many of its tokens it was told.
:meth:`Told.describe` turns the scheduled requests into the message's rows: in full when the runner
holds nothing of theirs (``NewRequest``), else what changed since they were last scheduled
(``CachedRequest``), counting the step in flight under asynchronous scheduling (:class:`InFlight`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from corerun.core.batch import BlockIds, CachedRequest, NewRequest, ScheduledBatch
from corerun.core.sequence import Sequence


@dataclass(frozen=True)
class InFlight:
    """What the step in flight does for one sequence (asynchronous scheduling): computes ``computed``
    tokens, appends at most ``appended`` tokens (a placeholder count: 1, or 1 + its drafts, as if all
    were accepted); ``last``: its first appended token ends the request."""

    computed: int = 0
    appended: int = 0
    last: bool = False


_NOTHING_IN_FLIGHT = InFlight()


class Told:
    def __init__(self) -> None:
        self.table_len: dict[int, int] = {}  # seq_id -> its block table's length as reported
        self.pending: dict[int, BlockIds] = {}  # seq_id -> its table's change not yet handed out
        self.tokens: dict[int, int] = {}  # seq_id -> tokens of it the runner was told
        self.lora_slot_of: dict[int, int] = {}  # seq_id -> its adapter's device slot (held while it runs)

    def note(self, seq_id: int, change: BlockIds) -> None:
        """``seq_id``'s table changed by ``change``: handed out when it is next scheduled."""
        before = self.pending.get(seq_id)
        self.pending[seq_id] = change if before is None else before.then(change)
        self.table_len[seq_id] = change.start + len(change.ids)

    def forget(self, seq_id: int) -> None:
        """``seq_id``'s blocks were freed: the runner drops it, and its next table is reported whole."""
        self.table_len.pop(seq_id, None)
        self.pending.pop(seq_id, None)
        self.tokens.pop(seq_id, None)

    def describe(self, items: list[tuple[Sequence, int]], resumed: frozenset[int],
                 in_flight: dict[int, InFlight]) -> tuple[list[NewRequest], list[CachedRequest]]:
        """The scheduled sequences as the runner is told them (``resumed``: scheduled again after a preemption)."""
        new_reqs: list[NewRequest] = []
        cached: list[CachedRequest] = []
        for seq, _ in items:
            sid = seq.seq_id
            change = self.pending.pop(sid, None)
            start = self.tokens.get(sid)
            self.tokens[sid] = seq.num_tokens
            if start is None:
                if change is not None and change.start != 0:
                    raise RuntimeError(f"sequence {sid} is new to the runner but its block-table change starts at {change.start}")
                new_reqs.append(NewRequest(
                    sid, tuple(seq.prompt_token_ids), tuple(seq.token_ids[seq.num_prompt_tokens:]), seq.params,
                    tuple(change.ids) if change is not None else (), seq.num_computed_tokens,
                    len(seq.prompt_logprobs or ()), sid in resumed, seq.lora, self.lora_slot_of.get(sid, -1),
                ))
            else:
                ahead = in_flight.get(sid, _NOTHING_IN_FLIGHT)
                cached.append(CachedRequest(sid, start, tuple(seq.token_ids[start:]), seq.num_tokens + ahead.appended,
                                            change, seq.num_computed_tokens + ahead.computed))
        return new_reqs, cached


def make_batch(rows: list[tuple[int, int]], new_reqs: tuple[NewRequest, ...], cached: tuple[CachedRequest, ...],
               drafts: dict[int, tuple[int, ...]], finished: frozenset[int], preempted: frozenset[int]) -> ScheduledBatch:
    """The message for ``rows`` (seq_id, tokens scheduled), decodes (one token) first."""
    rows = sorted(rows, key=lambda r: r[1] != 1)  # (stable)
    return ScheduledBatch(tuple(sid for sid, _ in rows), tuple(n for _, n in rows), sum(1 for _, n in rows if n == 1),
                          new_reqs, cached, MappingProxyType(drafts), finished, preempted)
