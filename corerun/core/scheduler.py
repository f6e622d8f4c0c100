"""Continuous batching with chunked prefill and preemption by recompute (vLLM v1's unified step).

Each step has a token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``).
Running sequences go first (a decode needs one token; a sequence in the middle of a chunked prefill
needs the rest of its prompt, cut to the budget); waiting sequences are then admitted in arrival
order while budget, cap and free blocks allow.  When a running sequence cannot get a block, the most
recently arrived running sequence is preempted: its blocks are freed, its computed tokens forgotten,
and it goes back to the front of the queue to be recomputed (prefix caching usually brings most of
it back for free).  No request is lost, and the oldest always makes progress.

The scheduler states what changed (protocol version 2, as vLLM v1's ``SchedulerOutput``): each batch
carries, per scheduled sequence whose block table changed, the new entries (``new_block_ids``), the
sequences resumed after a preemption, and the sequences finished or aborted since the previous
batch, so the runner and the sampler keep their per-request state from what they are told instead
of guessing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from corerun.core.sequence import Sequence, SequenceStatus
from corerun.errors import StepError
from corerun.protocols.kv_cache import KVCacheManager


class SchedulingError(StepError):
    """The KV-cache manager raised while the scheduler worked on ``seq`` (``None`` when no sequence was current).

    The scheduler's own state stays consistent: ``seq`` is still in ``running`` or ``waiting``, so the
    engine can end it (and only it) with an error; allocations already made for others in the same
    call are kept, and the next ``schedule()`` reuses them.
    """

    def __init__(self, seq: Sequence | None, cause: BaseException) -> None:
        self.seq = seq
        self.cause = cause
        super().__init__(f"{type(cause).__name__}: {cause}")


@dataclass(frozen=True)
class InFlight:
    """What the step in flight does for one sequence (asynchronous scheduling): computes ``computed``
    tokens, appends ``appended`` (0 or 1) sampled tokens; ``last``: the appended token ends the request."""

    computed: int = 0
    appended: int = 0
    last: bool = False


_NOTHING_IN_FLIGHT = InFlight()


class BlockIds(NamedTuple):
    """A change to one sequence's block table: its entries from ``start`` on are now ``ids`` (whatever
    lay at ``start`` or beyond is gone).  ``start`` 0: the whole table (a sequence scheduled for the first
    time, or again after a preemption); ``start`` at the old length: blocks appended; a ``start``
    below the old length: the table was trimmed (speculative decoding), then maybe grew again."""

    start: int
    ids: list[int]

    def then(self, later: BlockIds) -> BlockIds:
        """This change followed by ``later``, as one change."""
        if later.start <= self.start:
            return later
        return BlockIds(self.start, self.ids[: later.start - self.start] + later.ids)

    def apply(self, table: list[int]) -> list[int]:
        """``table`` after this change (a new list)."""
        return table[: self.start] + self.ids


@dataclass
class ScheduledBatch:
    """One step: ``seqs[i]`` computes ``num_new[i]`` tokens starting at ``seqs[i].num_computed_tokens``.

    Decodes (one new token) come first, as ``AttentionBatch.num_decodes`` expects.  A decode that
    carries draft tokens (speculative decoding) computes ``1 + len(drafts[seq_id])`` tokens: its last
    token, then the drafts, which are not in ``seq.token_ids`` (the step verifies them).

    What changed since the previous batch (protocol version 2), for a runner that keeps per-request
    state across steps; apply ``finished_ids`` first, then ``new_block_ids``:

    - ``new_block_ids``: seq_id -> :class:`BlockIds`, for each scheduled sequence whose block table
      changed since the last batch that scheduled it (a sequence scheduled for the first time or
      resumed has its whole table, ``start`` 0).  A scheduled sequence without an entry has the table
      it had when last scheduled.  Replaying every batch's entries gives each scheduled sequence's
      ``KVCacheManager.block_table``.
    - ``resumed_ids``: scheduled again after a preemption (its entry starts at 0).
    - ``preempted``: preempted while this batch was scheduled (``preempted_ids``); their blocks are
      freed and they come back later with a new table.
    - ``finished_ids``: finished or aborted since the previous batch; their seq_ids are never
      scheduled again, so their state can go.
    """

    seqs: list[Sequence]
    num_new: list[int]
    num_decodes: int
    preempted: list[Sequence]
    drafts: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> draft tokens verified this step
    new_block_ids: dict[int, BlockIds] = field(default_factory=dict)
    resumed_ids: frozenset[int] = frozenset()
    finished_ids: frozenset[int] = frozenset()

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    @property
    def preempted_ids(self) -> frozenset[int]:
        return frozenset(s.seq_id for s in self.preempted)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool = True,
        propose: Callable[[Sequence, int], list[int]] | None = None,
    ) -> None:
        self.kv = kv_cache
        # speculative decoding: propose(seq, at_most) -> draft tokens for a decode (corerun.spec_decode)
        self.propose = propose
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self._current: Sequence | None = None  # the sequence the KV-cache manager is working on
        # what the runner is told (protocol version 2): per sequence holding blocks, its table's length
        # as reported; changes not yet handed out (its sequence not scheduled since); finished seq_ids
        self._reported: dict[int, int] = {}
        self._pending: dict[int, BlockIds] = {}
        self._finished: list[int] = []
        # asynchronous scheduling: seq_id -> what the step still running does for it, not yet in the
        # sequence (see :meth:`set_in_flight`)
        self.in_flight: dict[int, InFlight] = {}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    # ----------------------------------------------------------------- step
    def schedule(self) -> ScheduledBatch:
        """The next step's batch. Raises :class:`SchedulingError` naming the sequence the KV-cache manager failed on."""
        self._current = None
        try:
            return self._schedule()
        except Exception as exc:
            raise SchedulingError(self._current, exc) from exc

    def _schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        scheduled: dict[int, int] = {}  # seq_id -> num_new
        preempted: list[Sequence] = []
        drafts: dict[int, list[int]] = {}
        resumed: list[int] = []

        # 1. running sequences, oldest first; preempt the youngest when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            ahead = self.in_flight.get(seq.seq_id, _NOTHING_IN_FLIGHT)
            if ahead.last:  # its token in flight is its last (max_tokens, max_model_len): nothing to schedule
                i += 1
                continue
            computed = seq.num_computed_tokens + ahead.computed
            n = min(seq.num_tokens + ahead.appended - computed, budget)
            if not self.chunked_prefill and n < seq.num_tokens + ahead.appended - computed:
                break  # whole prefills only: wait for a step with room
            if n == 1 and self.propose is not None and budget > 1:
                d = self.propose(seq, budget - 1)  # drafts only where their slots are free: never a preemption
                if d and self._allocate(seq, computed + 1 + len(d)):
                    drafts[seq.seq_id] = d
                    scheduled[seq.seq_id] = 1 + len(d)
                    budget -= 1 + len(d)
                    i += 1
                    continue
            while not self._allocate(seq, computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled[seq.seq_id] = n
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted: nothing younger is left running

        # 2. waiting sequences in arrival order (preempted ones were put at the front)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self._current = self.waiting[0]
            if seq.num_computed_tokens == 0 and not seq.wants_prompt_logprobs:
                # (prompt logprobs need every prompt position's hidden state: no prefix reuse)
                seq.num_computed_tokens = self.kv.get_computed_prefix(seq.seq_id, seq.token_ids)
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget)
            if not self.chunked_prefill and n < remaining:
                self._release(seq)
                break
            if not self._allocate(seq, seq.num_computed_tokens + n):
                self._release(seq)
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[seq.seq_id] = n
            budget -= n
            if seq.num_preemptions:
                resumed.append(seq.seq_id)

        by_id = {s.seq_id: s for s in self.running}
        items = [(by_id[sid], n) for sid, n in scheduled.items()]
        items.sort(key=lambda it: it[1] != 1)  # decodes first (stable)
        num_decodes = sum(1 for _, n in items if n == 1)
        drafts = {sid: d for sid, d in drafts.items() if sid in by_id}  # (a drafting seq preempted later)
        pending = self._pending
        changes = {s.seq_id: pending.pop(s.seq_id) for s, _ in items if s.seq_id in pending}
        finished: frozenset[int] = frozenset()
        if items:  # (an empty batch reaches no runner: the finished ids wait for the next one)
            finished, self._finished = frozenset(self._finished), []
        return ScheduledBatch(
            [s for s, _ in items], [n for _, n in items], num_decodes, preempted, drafts,
            changes, frozenset(sid for sid in resumed if sid in by_id), finished,
        )

    def set_in_flight(self, batch: ScheduledBatch, appends: list[bool], last: list[bool]) -> None:
        """Asynchronous scheduling: ``batch`` runs while the next one is scheduled.  Each of its
        sequences will have computed its ``num_new`` tokens, and one token more when ``appends[i]``
        (a placeholder until the step's result comes); ``last[i]``: that token is certainly its last."""
        self.in_flight = {
            s.seq_id: InFlight(n, int(a), z) for s, n, a, z in zip(batch.seqs, batch.num_new, appends, last)
        }

    def clear_in_flight(self) -> None:
        """The step in flight has been collected: schedule from the sequences' own counts again."""
        self.in_flight = {}

    def _allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """``allocate_slots``; when the table had to grow, the new entries are noted for the runner."""
        self._current = seq
        if not self.kv.allocate_slots(seq.seq_id, num_tokens):
            return False
        sid = seq.seq_id
        have = self._reported.get(sid, 0)
        if num_tokens > have * self.kv.block_size:
            self._note(sid, BlockIds(have, list(self.kv.new_block_ids(sid, have))))
        return True

    def _note(self, seq_id: int, change: BlockIds) -> None:
        before = self._pending.get(seq_id)
        self._pending[seq_id] = change if before is None else before.then(change)
        self._reported[seq_id] = change.start + len(change.ids)

    def _forget(self, seq_id: int) -> None:
        """``seq_id``'s blocks were freed: its next table is reported whole."""
        self._reported.pop(seq_id, None)
        self._pending.pop(seq_id, None)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks ``seq`` holds beyond ``num_tokens`` tokens (``KVCacheManager.trim``, when the
        manager has it; speculative decoding's rejected drafts), and tell the runner its table shrank."""
        trim = getattr(self.kv, "trim", None)
        if trim is None:
            return
        kept = trim(seq.seq_id, num_tokens)
        if not isinstance(kept, int) or isinstance(kept, bool):
            raise TypeError(
                f"KVCacheManager.trim({seq.seq_id}, {num_tokens}) returned {kept!r}; protocol version 2 wants the "
                "number of blocks the table keeps (an int)"
            )
        if kept < self._reported.get(seq.seq_id, 0):
            self._note(seq.seq_id, BlockIds(kept, []))

    def _release(self, seq: Sequence) -> None:
        """Undo a failed admission: drop the prefix blocks it claimed."""
        self._current = seq
        self.kv.free(seq.seq_id)
        self._forget(seq.seq_id)
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        self._current = seq
        self.kv.free(seq.seq_id)  # first: if it raises, seq is still running, whole
        self._forget(seq.seq_id)
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------- finishing
    def finish(self, seq: Sequence, reason: str) -> None:
        """Take ``seq`` out of the queues, mark it finished, then free its blocks.

        The blocks are freed last, so that a KV-cache manager raising in ``free`` leaves the
        scheduler consistent (the exception propagates; ``seq`` is finished either way).
        """
        if seq in self.running:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._forget(seq.seq_id)
        self._finished.append(seq.seq_id)
        self.kv.free(seq.seq_id)
