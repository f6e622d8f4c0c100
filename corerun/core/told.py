"""What the runner has been told of each request (protocol version 3), and the messages that tell it.

Per request holding blocks: its block table's length as reported and the changes not yet handed out
(its request not scheduled since); per request the runner holds: how many of its tokens it was told.
:meth:`Told.describe` turns the scheduled requests into the message: in full when the runner holds
nothing of theirs (``NewRequest``), else only what changed since they were last scheduled and the
runner did not sample itself (``NewTokens``, ``BlockIds``), counting the step in flight under
asynchronous scheduling (:class:`InFlight`); a decode whose table kept its length is not described.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Container
from types import MappingProxyType

from corerun.core.batch import BlockIds, NewRequest, NewTokens, ScheduledBatch
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

    def describe(self, seqs: list[Sequence], scheduled: Container[int], resumed: frozenset[int],
                 in_flight: dict[int, InFlight]) -> tuple[list[NewRequest], dict[int, NewTokens], dict[int, BlockIds]]:
        """The scheduled ``seqs`` (their ids: ``scheduled``) as the runner is told them (``resumed``:
        scheduled again after a preemption): those it holds nothing of in full, of the others only what changed.  A request
        whose tokens the runner sampled itself (:meth:`sampled`) and whose table kept its length
        costs one dictionary look-up."""
        new_reqs: list[NewRequest] = []
        new_tokens: dict[int, NewTokens] = {}
        told, pending = self.tokens, self.pending
        for seq in seqs:
            sid, num_tokens = seq.seq_id, len(seq.token_ids)
            start = told.get(sid)
            if start == num_tokens:
                continue
            told[sid] = num_tokens
            if start is None:
                change = pending.pop(sid, None)
                if change is not None and change.start != 0:
                    raise RuntimeError(f"sequence {sid} is new to the runner but its block-table change starts at {change.start}")
                new_reqs.append(NewRequest(
                    sid, tuple(seq.prompt_token_ids), tuple(seq.token_ids[seq.num_prompt_tokens:]), seq.params,
                    tuple(change.ids) if change is not None else (), seq.num_computed_tokens,
                    len(seq.prompt_logprobs or ()), sid in resumed, seq.lora, self.lora_slot_of.get(sid, -1),
                ))
            else:
                ahead = in_flight.get(sid, _NOTHING_IN_FLIGHT)
                new_tokens[sid] = NewTokens(start, tuple(seq.token_ids[start:]), num_tokens + ahead.appended)
        changes = {sid: pending.pop(sid) for sid in [sid for sid in pending if sid in scheduled]}  # (a few a step)
        return new_reqs, new_tokens, changes

    def sampled(self, seq_id: int, before: int, after: int) -> None:
        """The runner sampled ``seq_id``'s tokens from ``before`` to ``after`` and holds them: when it was
        told every token before them, it need not be told these."""
        if self.tokens.get(seq_id) == before:
            self.tokens[seq_id] = after


def make_batch(rows: list[tuple[int, int, int]], new_reqs: tuple[NewRequest, ...], new_tokens: dict[int, NewTokens],
               block_changes: dict[int, BlockIds], drafts: dict[int, tuple[int, ...]], finished: frozenset[int],
               preempted: frozenset[int]) -> ScheduledBatch:
    """The message for ``rows`` (seq_id, tokens scheduled, computed count), decodes (one token) first."""
    decodes = [r for r in rows if r[1] == 1]
    if len(decodes) < len(rows):
        rows = decodes + [r for r in rows if r[1] != 1]
    ids, num, computed = zip(*rows) if rows else ((), (), ())
    return ScheduledBatch(ids, num, len(decodes), new_reqs, computed, MappingProxyType(new_tokens),
                          MappingProxyType(block_changes), MappingProxyType(drafts), finished, preempted)
