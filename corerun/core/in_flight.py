"""Asynchronous scheduling's side of the scheduler: the step in flight and the rows scheduled past it.

While step N runs, step N+1 is scheduled as if N's sequences had computed N's tokens and, reaching
their last, appended one token plus every draft (placeholder counts, :meth:`InFlightSteps.set_in_flight`);
rows of decodes scheduled that way with speculation are told as they really are once N's result and
the next drafts are in (:meth:`InFlightSteps.settle`).  :class:`corerun.core.scheduler.Scheduler`
holds the state (``in_flight``, ``_guessed``, ``_moved``) and the rest of the step.
"""

from __future__ import annotations

from typing import Any

from corerun.core.batch import InFlight, ScheduledBatch, make_batch


class InFlightSteps:
    """The :class:`~corerun.core.scheduler.Scheduler`'s methods for the step in flight (a base class of it)."""

    in_flight: dict[int, InFlight]
    _moved: set[int]
    _guessed: dict[int, int]
    _seqs: dict[int, Any]
    told: Any
    max_model_len: int
    seqs_of: Any  # (Scheduler.seqs_of, Scheduler.trim)
    trim: Any

    def settle(self, batch: ScheduledBatch) -> ScheduledBatch:
        """Asynchronous scheduling with speculation: ``batch``'s decodes of requests in the step before it were
        scheduled from placeholder counts (every draft accepted); now that its result and the next drafts are
        in, those rows are told as they are (counts, drafts up to the slots held), the blocks past them freed."""
        guessed, self._guessed = self._guessed, {}
        if not guessed:
            return batch
        rows = {sid: (None, n, c) for sid, n, c in zip(batch.req_ids, batch.num_scheduled, batch.num_computed)}
        drafts, new_tokens, changes = dict(batch.drafts), dict(batch.new_tokens), dict(batch.block_changes)
        for sid, room in guessed.items():
            seq = self._seqs.get(sid)
            if seq is None or seq.is_finished or sid not in rows:  # (a finished one's row is dropped by the caller)
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, rows[sid][1])
            d = tuple(seq.draft_token_ids[:room]) if n == 1 else ()
            self.trim(seq, seq.num_computed_tokens + n + len(d))
            self.told.settle(seq, changes, new_tokens)
            rows[sid] = (None, n + len(d), seq.num_computed_tokens)
            drafts.pop(sid, None)
            if d:
                drafts[sid] = d
        return make_batch(rows, batch.new_reqs, new_tokens, changes, drafts, batch.finished_ids, batch.preempted_ids)

    def set_in_flight(self, batch: ScheduledBatch) -> None:
        """Asynchronous scheduling: ``batch`` runs while the next is scheduled; its sequences count its tokens as
        computed and, reaching their last, 1 + drafts placeholder tokens (one that ends the request: nothing left)."""
        flight = {}
        for s, n in zip(self.seqs_of(batch), batch.num_scheduled):
            if s is not None:
                appends = s.num_computed_tokens + n >= s.num_tokens
                flight[s.seq_id] = InFlight(n, appends * (1 + len(batch.drafts.get(s.seq_id, ()))),
                                            appends and s.tokens_left(self.max_model_len) <= 1)
        self.in_flight = flight

    def clear_in_flight(self) -> None:
        """The step in flight failed: nothing it was to do happened."""
        self.in_flight, self._moved, self._guessed = {}, set(), {}
