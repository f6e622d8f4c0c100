"""What crosses between the scheduler and the runner each step: :class:`ScheduledBatch` down,
:class:`StepResult` up (vLLM v1's ``SchedulerOutput`` and ``ModelRunnerOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from corerun.core.sequence import Sequence


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

    def only(self, keep: list[int]) -> ScheduledBatch:
        """This batch with only its sequences ``keep`` (indices, in order): the per-sequence fields follow."""
        ids = {self.seqs[i].seq_id for i in keep}
        return replace(
            self, seqs=[self.seqs[i] for i in keep], num_new=[self.num_new[i] for i in keep],
            num_decodes=sum(1 for i in keep if i < self.num_decodes),
            drafts={k: v for k, v in self.drafts.items() if k in ids},
            new_block_ids={k: v for k, v in self.new_block_ids.items() if k in ids},
            resumed_ids=self.resumed_ids & ids,
        )

    def telling(self, earlier: ScheduledBatch) -> ScheduledBatch:
        """This batch also telling what the unlaunched ``earlier`` told: the sequences finished before it."""
        if not earlier.finished_ids:
            return self
        return replace(self, finished_ids=earlier.finished_ids | self.finished_ids)


@dataclass
class StepResult:
    """What one step produced for the sequences that completed their scheduled tokens."""

    sampled: list[int]  # next token per row of ``rows``
    rows: list[int]  # indices into ScheduledBatch.seqs that were sampled
    logprobs: Any  # LogprobsTensors of the rows, or None
    prompt_logprobs: dict[int, tuple[int, Any]]  # row -> (first target position, LogprobsTensors)
    ended: dict[int, str] = field(default_factory=dict)  # row -> "stop" or an error: a logits processor ended it
    # speculative decoding: row -> the tokens it gets after sampled[j] (accepted drafts, then the token
    # sampled after them); rows absent got one token
    more: dict[int, list[int]] = field(default_factory=dict)

    def emitted(self, row_index: int) -> list[int]:
        """Every token row ``rows[row_index]`` gets this step, in order."""
        return [self.sampled[row_index], *self.more.get(self.rows[row_index], ())]
