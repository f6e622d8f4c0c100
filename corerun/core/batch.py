"""What crosses between the scheduler and the runner each step, as plain immutable values:
:class:`ScheduledBatch` down, :class:`StepResult` up (vLLM v1's ``SchedulerOutput`` and
``ModelRunnerOutput``).  No live object crosses: the runner keeps its own per-request state
(:mod:`corerun.runner.input_batch`) and changes it only by applying each batch.

The scheduler builds each message with :class:`Told`, its record of what the runner was told (per
request holding blocks: its table's length as reported and the changes not yet handed out; per
request the runner holds: how many of its tokens it knows): a request in full when the runner holds
nothing of it (``NewRequest``), else only what changed since it was last scheduled and the runner did
not sample itself (``NewTokens``, ``BlockIds``), counting the step in flight under asynchronous
scheduling (:class:`InFlight`).  A decode whose table kept its length is not described at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple

from corerun.lora.request import LoRARequest
from corerun.sampling_params import SamplingParams

if TYPE_CHECKING:
    from corerun.core.sequence import Sequence

_NONE: Mapping[int, Any] = MappingProxyType({})


class BlockIds(NamedTuple):
    """A change to one request's block table: its entries from ``start`` on are now ``ids`` (whatever
    lay at ``start`` or beyond is gone).  ``start`` at the old length: blocks appended; a ``start``
    below it: the table was trimmed (speculative decoding's rejected drafts), then maybe grew again."""

    start: int
    ids: tuple[int, ...]

    def then(self, later: BlockIds) -> BlockIds:
        """This change followed by ``later``, as one change."""
        if later.start <= self.start:
            return later
        return BlockIds(self.start, self.ids[: later.start - self.start] + tuple(later.ids))

    def apply(self, table: list[int]) -> list[int]:
        """``table`` after this change (a new list)."""
        return list(table[: self.start]) + list(self.ids)


class NewRequest(NamedTuple):
    """A request scheduled for the first time, or again after a preemption: everything the runner keeps
    (a named tuple: a few of them are built every step, and a tuple costs a tenth of a frozen dataclass).

    ``num_prompt_logprobs``: prompt-logprob entries the request already holds (a resumed request's are
    kept, so the runner computes only the positions after them).
    """

    seq_id: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    params: SamplingParams
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    num_prompt_logprobs: int = 0
    resumed: bool = False  # scheduled again after a preemption
    lora: LoRARequest | None = None  # the adapter it runs under (corerun.lora); None: the base model
    lora_slot: int = -1  # the device slot the scheduler gave that adapter; -1: none


class NewTokens(NamedTuple):
    """Tokens of a request the runner holds that it has not got from its own sampling (a draft model's
    copy rewound, a test's tokens appended by hand): its tokens from ``start`` on are ``ids``, and it
    has ``num_tokens`` in all (under asynchronous scheduling counting the token in flight, which the
    runner sampled itself)."""

    start: int
    ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class ScheduledBatch:
    """One step: row ``i`` is request ``req_ids[i]``, computing ``num_scheduled[i]`` tokens from its
    computed count ``num_computed[i]``.  Decodes (one token) come first, as ``AttentionBatch.num_decodes``
    expects; a decode with drafts (``drafts[seq_id]``, speculative decoding) computes ``1 + len(drafts)``
    tokens: its last token, then the drafts, which the step verifies.

    Requests the runner holds cost nothing beyond their row unless they changed (vLLM v1's
    ``CachedRequestData``): the tokens the runner sampled it already holds, so only tokens it did not
    sample come in ``new_tokens``, and only tables that changed in ``block_changes``.  ``num_computed``
    may be empty when every row is a new request (whose ``NewRequest`` says it).

    Apply in this order (:meth:`corerun.runner.input_batch.InputBatch.apply`): drop ``finished_ids``
    and ``preempted_ids`` (gone for good; preempted: their blocks are freed and they come back as new
    requests), add ``new_reqs`` (scheduled for the first time or resumed), write ``new_tokens`` and
    ``block_changes``, set every row's computed count.
    """

    req_ids: tuple[int, ...]
    num_scheduled: tuple[int, ...]
    num_decodes: int
    new_reqs: tuple[NewRequest, ...] = ()
    num_computed: tuple[int, ...] = ()
    new_tokens: Mapping[int, NewTokens] = field(default_factory=lambda: _NONE)
    block_changes: Mapping[int, BlockIds] = field(default_factory=lambda: _NONE)
    drafts: Mapping[int, tuple[int, ...]] = field(default_factory=lambda: _NONE)
    finished_ids: frozenset[int] = frozenset()
    preempted_ids: frozenset[int] = frozenset()

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled)

    @property
    def resumed_ids(self) -> frozenset[int]:
        """Requests scheduled again after a preemption (among ``new_reqs``)."""
        return frozenset(r.seq_id for r in self.new_reqs if r.resumed)

    @property
    def new_block_ids(self) -> dict[int, BlockIds]:
        """Each scheduled request's block-table change in this batch: a new or resumed one's whole table
        (``start`` 0), the others' changes; a request without an entry kept its table."""
        out = {r.seq_id: BlockIds(0, r.block_ids) for r in self.new_reqs}
        out.update(self.block_changes)
        return out

    def __bool__(self) -> bool:
        return bool(self.req_ids)

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        """Pickles with its mappings as plain dicts (a read-only mapping view does not pickle): tensor-parallel
        rank 0 sends the batch to its workers as it is."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update((name, dict(values[name])) for name in _MAPPINGS)
        return _unpickled_batch, (values,)

    def only(self, keep: list[int]) -> ScheduledBatch:
        """This batch with only its rows ``keep`` (indices, in order): the per-request fields follow."""
        ids = frozenset(self.req_ids[i] for i in keep)
        return replace(
            self, req_ids=tuple(self.req_ids[i] for i in keep), num_scheduled=tuple(self.num_scheduled[i] for i in keep),
            num_decodes=sum(1 for i in keep if i < self.num_decodes),
            new_reqs=tuple(r for r in self.new_reqs if r.seq_id in ids),
            num_computed=tuple(self.num_computed[i] for i in keep) if self.num_computed else (),
            **{name: MappingProxyType({k: v for k, v in getattr(self, name).items() if k in ids}) for name in _MAPPINGS},
        )

    def telling(self, earlier: ScheduledBatch) -> ScheduledBatch:
        """This batch also telling what the unlaunched ``earlier`` told: the requests finished before it."""
        if not earlier.finished_ids:
            return self
        return replace(self, finished_ids=earlier.finished_ids | self.finished_ids)


_MAPPINGS = ("new_tokens", "block_changes", "drafts")


def _unpickled_batch(values: dict[str, Any]) -> ScheduledBatch:
    return ScheduledBatch(**{**values, **{name: MappingProxyType(values[name]) for name in _MAPPINGS}})


@dataclass
class StepResult:
    """What one step produced for the requests that completed their scheduled tokens."""

    sampled: list[int]  # next token per row of ``rows``
    rows: list[int]  # rows of the ScheduledBatch (indices into req_ids) that were sampled
    logprobs: Any  # LogprobsTensors of the rows, or None
    prompt_logprobs: dict[int, tuple[int, Any]]  # row -> (first target position, LogprobsTensors)
    ended: dict[int, str] = field(default_factory=dict)  # row -> "stop" or an error: a logits processor ended it
    # speculative decoding: row -> the tokens it gets after sampled[j] (accepted drafts, then the token
    # sampled after them); rows absent got one token
    more: dict[int, list[int]] = field(default_factory=dict)
    # embedding requests whose prompt this step completed: row -> the pooled vector (corerun.runner.pooling)
    pooled: dict[int, list[float]] = field(default_factory=dict)

    def emitted(self, row_index: int) -> list[int]:
        """Every token row ``rows[row_index]`` gets this step, in order."""
        return [self.sampled[row_index], *self.more.get(self.rows[row_index], ())]


# ----------------------------------------------------------------- building the message (the scheduler)
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

    def grew(self, seq_id: int, ids: list[int]) -> None:
        """``allocate_slots`` appended ``ids`` to ``seq_id``'s table."""
        start = self.table_len.get(seq_id, 0)
        if seq_id in self.pending:
            self.note(seq_id, BlockIds(start, tuple(ids)))
        else:  # (no change pending: a new request's first table, or a decode's next block)
            self.pending[seq_id] = BlockIds(start, tuple(ids))
            self.table_len[seq_id] = start + len(ids)

    def trimmed(self, seq_id: int, kept: int) -> None:
        """``seq_id``'s table was cut to its first ``kept`` blocks."""
        if kept < self.table_len.get(seq_id, 0):
            self.note(seq_id, BlockIds(kept, ()))

    def rewind(self, seq_id: int, num_tokens: int) -> None:
        """``seq_id``'s tokens past ``num_tokens`` were replaced: the runner is told them again."""
        if self.tokens.get(seq_id, 0) > num_tokens:
            self.tokens[seq_id] = num_tokens

    def settle(self, seq: Sequence, changes: dict[int, BlockIds], new_tokens: dict[int, NewTokens]) -> None:
        """``seq``'s row, scheduled from placeholder counts, as it is now (``Scheduler.settle``): its table's
        later change merged into ``changes``, tokens it was told with placeholders told again as they are."""
        sid = seq.seq_id
        later = self.pending.pop(sid, None)
        if later is not None:
            changes[sid] = changes[sid].then(later) if sid in changes else later
        told = new_tokens.get(sid)
        if told is not None:
            new_tokens[sid] = NewTokens(told.start, tuple(seq.token_ids[told.start:]), len(seq.token_ids))
            self.tokens[sid] = len(seq.token_ids)

    def forget(self, seq_id: int) -> None:
        """``seq_id``'s blocks were freed: the runner drops it, and its next table is reported whole."""
        self.table_len.pop(seq_id, None)
        self.pending.pop(seq_id, None)
        self.tokens.pop(seq_id, None)

    def describe(self, scheduled: dict[int, tuple[Sequence, int, int]], resumed: frozenset[int],
                 in_flight: dict[int, InFlight]) -> tuple[list[NewRequest], dict[int, NewTokens], dict[int, BlockIds]]:
        """The ``scheduled`` sequences (seq_id -> (sequence, ...)) as the runner is told them (``resumed``:
        scheduled again after a preemption): those it holds nothing of in full, of the others only what changed.  A request
        whose tokens the runner sampled itself (:meth:`sampled`) and whose table kept its length
        costs one dictionary look-up."""
        new_reqs: list[NewRequest] = []
        new_tokens: dict[int, NewTokens] = {}
        told, pending = self.tokens, self.pending
        for sid, (seq, _, _) in scheduled.items():
            num_tokens = len(seq.token_ids)
            start = told.get(sid)
            if start == num_tokens:
                continue
            told[sid] = num_tokens
            if start is None:
                new_reqs.append(self._new_request(sid, seq, sid in resumed))
            else:
                ahead = in_flight.get(sid, _NOTHING_IN_FLIGHT)
                new_tokens[sid] = NewTokens(start, tuple(seq.token_ids[start:]), num_tokens + ahead.appended)
        changes = {sid: pending.pop(sid) for sid in [sid for sid in pending if sid in scheduled]}  # (a few a step)
        return new_reqs, new_tokens, changes

    def _new_request(self, sid: int, seq: Sequence, resumed: bool) -> NewRequest:
        """``seq`` in full, for a runner that holds nothing of it (its table's change, pending, goes with it)."""
        change = self.pending.pop(sid, None)
        if change is not None and change.start != 0:
            raise RuntimeError(f"sequence {sid} is new to the runner but its block-table change starts at {change.start}")
        tokens, prompt = seq.token_ids, seq.prompt_token_ids  # (the prompt: the tuple the request arrived with, not a copy)
        return NewRequest(
            sid, prompt, tuple(tokens[len(prompt):]) if len(tokens) > len(prompt) else (), seq.params,
            change.ids if change is not None else (), seq.num_computed_tokens,
            len(seq.prompt_logprobs or ()), resumed, seq.lora, self.lora_slot_of.get(sid, -1),
        )

    def sampled(self, seq_id: int, before: int, after: int) -> None:
        """The runner sampled ``seq_id``'s tokens from ``before`` to ``after`` and holds them: when it was
        told every token before them, it need not be told these."""
        if self.tokens.get(seq_id) == before:
            self.tokens[seq_id] = after


def make_batch(rows: dict[int, tuple[Any, int, int]], new_reqs: tuple[NewRequest, ...], new_tokens: dict[int, NewTokens],
               block_changes: dict[int, BlockIds], drafts: dict[int, tuple[int, ...]], finished: frozenset[int],
               preempted: frozenset[int]) -> ScheduledBatch:
    """The message for ``rows`` (seq_id -> (its sequence, tokens scheduled, computed count)), decodes
    (one token) first.  Built without the frozen dataclass's ``__init__``, which sets each field through
    ``object.__setattr__`` (three times the cost, once per step); as frozen."""
    ids, num, computed = tuple(rows), (), ()
    if rows:
        _, num, computed = zip(*rows.values())
    d = num.count(1)
    if num[:d].count(1) != d:  # (a one-token chunk scheduled after a longer one: reordered, stably)
        order = sorted(range(len(num)), key=lambda i: num[i] != 1)
        ids, num, computed = (tuple([t[i] for i in order]) for t in (ids, num, computed))
    batch = object.__new__(ScheduledBatch)
    object.__setattr__(batch, "__dict__", {
        "req_ids": ids, "num_scheduled": num, "num_decodes": d, "new_reqs": new_reqs, "num_computed": computed,
        "new_tokens": _read_only(new_tokens), "block_changes": _read_only(block_changes), "drafts": _read_only(drafts),
        "finished_ids": finished, "preempted_ids": preempted,
    })
    return batch


def _read_only(mapping: dict[int, Any]) -> Mapping[int, Any]:
    return MappingProxyType(mapping) if mapping else _NONE


if tuple(f.name for f in fields(ScheduledBatch)) != ("req_ids", "num_scheduled", "num_decodes", "new_reqs", "num_computed", "new_tokens",
                                                     "block_changes", "drafts", "finished_ids", "preempted_ids"):
    raise AssertionError("make_batch sets every field of ScheduledBatch by name: add a new field there")  # pragma: no cover
