"""Draft-model proposals: a smaller model of the target's vocabulary decodes greedily ahead of it.

The proposer drives its own model runner (any object with ``execute(batch, eos_token_ids)`` and a
``kv_manager``; the engine builds a :class:`corerun.runner.model_runner.ModelRunner` for the draft
model) through a private :class:`corerun.core.scheduler.Scheduler`.  It keeps one draft sequence per
target request across steps, so a step computes only the tokens the draft has not seen (those the
target accepted or sampled since, after the longest prefix the two share) and then decodes greedily;
the requests of a step are proposed for together, one batch per draft token.

A greedy draft is a function of the context: its proposal distribution is a point mass, so the
verifier of :mod:`corerun.spec_decode.verify` stays the exact rejection sampler.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence as SequenceT

from corerun.core.scheduler import Scheduler
from corerun.core.sequence import Sequence, SequenceStatus
from corerun.sampling_params import SamplingParams
from corerun.spec_decode.proposer import Proposer

logger = logging.getLogger("corerun.spec_decode")

_GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


class DraftModelProposer(Proposer):
    """Up to ``num_tokens`` greedy tokens of the draft model per request and step.

    :meth:`propose` runs the draft for the requests about to decode and returns their drafts;
    :meth:`release` frees a request's draft state (its blocks in the draft's cache).
    """

    def __init__(self, runner: Any, num_tokens: int, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self.runner = runner
        self.num_tokens = num_tokens
        self.scheduler = Scheduler(
            runner.kv_manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        )
        self.seqs: dict[int, Sequence] = {}  # target seq_id -> the draft's copy of its tokens (+ last drafts)
        self.drafts: dict[int, list[int]] = {}  # target seq_id -> this step's drafts (prepare)
        self._seen: dict[int, int] = {}  # target seq_id -> its length at the last prepare
        self.num_draft_steps = 0  # draft model steps run

    def propose(self, wanted: SequenceT[tuple[int, SequenceT[int], int]]) -> dict[int, list[int]]:
        """Draft for each ``(seq_id, token_ids, k)``, in one batch per draft token.  A draft step that
        fails is logged and this step has no drafts (the draft's state is dropped and rebuilt from the
        requests' tokens)."""
        try:
            self.run(wanted)
        except Exception as exc:
            logger.error("the draft model's step failed, this step has no drafts: %s: %s", type(exc).__name__, exc)
            self.reset()
            return {}
        return {seq_id: d for seq_id, d in self.drafts.items() if d}

    def run(self, wanted: SequenceT[tuple[int, SequenceT[int], int]]) -> None:
        """Draft for each ``(seq_id, token_ids, k)``: at most ``k`` greedy tokens to follow ``token_ids``.

        A request gets fewer than ``k`` when the draft's cache or step budget has no room for it
        (its long prompt is then computed over this step's draft steps and the next ones).
        """
        self.drafts = {}
        active: list[tuple[Sequence, int]] = []
        for seq_id, token_ids, k in wanted:
            ds = self.seqs.get(seq_id)
            if ds is None or ds.status is SequenceStatus.WAITING:  # new, or preempted in the draft's cache
                if ds is not None:
                    self.release(seq_id)
                ds = self.seqs[seq_id] = Sequence(seq_id, str(seq_id), list(token_ids), _GREEDY)
            else:
                same = _common_prefix(ds.token_ids, token_ids, self._seen.get(seq_id, 0))
                del ds.token_ids[same:]  # the drafts the target rejected (their K/V get overwritten)
                ds.token_ids += token_ids[same:]
                self.scheduler.rewind(ds, same)
            self._seen[seq_id] = len(token_ids)  # the target's tokens only grow: equal up to here next time
            self.drafts[seq_id] = []
            active.append((ds, k))
        sched = self.scheduler
        try:
            while active:
                sched.running = [ds for ds, _ in active]
                for ds in sched.running:
                    ds.status = SequenceStatus.RUNNING
                batch = sched.schedule()
                if not batch:
                    break
                result = self.runner.execute(batch, frozenset())
                self.num_draft_steps += 1
                seqs = sched.seqs_of(batch)
                for ds, n in zip(seqs, batch.num_scheduled):
                    ds.num_computed_tokens += n  # type: ignore[union-attr]
                for row, token in zip(result.rows, result.sampled):
                    ds = seqs[row]  # type: ignore[assignment]
                    ds.token_ids.append(token)
                    self.drafts[ds.seq_id].append(token)
                # (a draft sequence preempted for room is in sched.waiting: no more drafts for it this step)
                active = [(ds, k) for ds, k in active if ds in sched.running and len(self.drafts[ds.seq_id]) < k]
        finally:
            sched.running, sched.waiting = [], type(sched.waiting)()

    def release(self, seq_id: int) -> None:
        """Forget ``seq_id`` (its request finished, was aborted or preempted): its draft blocks are freed."""
        self.drafts.pop(seq_id, None)
        self._seen.pop(seq_id, None)
        ds = self.seqs.pop(seq_id, None)
        if ds is not None:
            self.scheduler.finish(ds, "stop")

    def reset(self) -> None:
        """Forget every request (after a draft step failed: the draft's state may be half-updated)."""
        for seq_id in list(self.seqs):
            self.release(seq_id)


def _common_prefix(a: SequenceT[int], b: SequenceT[int], start: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, given that the first ``start`` are equal."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i
