"""Pooling: embedding requests' final hidden states turned into one vector each.

An embedding request (``SamplingParams.pooling`` set) is scheduled like a prompt, in chunks if the
scheduler splits it; each step the runner keeps only the rows it needs of the step's hidden states:
the first token's (``cls``), a running float32 sum of its rows (``mean``, accumulated over chunks),
or, when the prompt's last token is computed, that token's (``last``).  The vector comes back in
:class:`~corerun.core.batch.StepResult` ``pooled`` (row -> floats) when its prompt is computed.

:meth:`Pooler.plan` reads the persistent batch when the step is prepared; :meth:`Pooler.pool` reads
only the plan and the hidden states, so it may run on the step thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from corerun.core.batch import ScheduledBatch
from corerun.runner.input_batch import InputBatch
from corerun.sampling_params import PoolingParams


@dataclass(frozen=True, slots=True)
class PoolRow:
    """One embedding request in a step: batch row ``row``, its hidden rows ``lo:hi`` (positions
    ``start:start + hi - lo`` of its prompt of ``num_prompt`` tokens)."""

    row: int
    seq_id: int
    lo: int
    hi: int
    start: int
    num_prompt: int
    params: PoolingParams

    @property
    def done(self) -> bool:
        return self.start + self.hi - self.lo >= self.num_prompt


@dataclass(frozen=True, slots=True)
class PoolPlan:
    rows: tuple[PoolRow, ...]
    gone: frozenset[int]  # requests whose partial sums are dropped (finished, preempted)


class Pooler:
    """Keeps the partial sums of ``mean`` and the first rows of ``cls`` requests between their chunks."""

    def __init__(self) -> None:
        self._partial: dict[int, torch.Tensor] = {}

    def plan(self, sched: ScheduledBatch, batch: InputBatch, query_start_loc: list[int]) -> PoolPlan | None:
        """The embedding requests of ``sched`` (already applied to ``batch``); None when it has none."""
        rows = []
        for i, sid in enumerate(sched.req_ids):
            r = batch.index[sid]
            p = batch.params[r]
            if p is not None and p.pooling is not None:
                lo = query_start_loc[i]
                rows.append(PoolRow(i, sid, lo, lo + sched.num_scheduled[i], int(batch.num_computed[r]),
                                    int(batch.num_prompt[r]), p.pooling))
        gone = (sched.finished_ids | sched.preempted_ids) & self._partial.keys()
        if not rows and not gone:
            return None
        return PoolPlan(tuple(rows), frozenset(gone))

    def pool(self, plan: PoolPlan | None, hidden: torch.Tensor) -> dict[int, list[float]]:
        """The finished requests' vectors (row -> floats); partial state kept for the others."""
        if plan is None:
            return {}
        for sid in plan.gone:
            self._partial.pop(sid, None)
        vectors: dict[int, torch.Tensor] = {}
        for pr in plan.rows:
            kind = pr.params.pooling_type
            if pr.start == 0:
                self._partial.pop(pr.seq_id, None)  # a fresh start (or a recompute after preemption)
            if kind == "mean":
                part = hidden[pr.lo : pr.hi].float().sum(0)
                held = self._partial.get(pr.seq_id)
                self._partial[pr.seq_id] = part if held is None else held + part
            elif kind == "cls" and pr.start == 0:
                self._partial[pr.seq_id] = hidden[pr.lo].float()
            if not pr.done:
                continue
            if kind == "last":
                vec = hidden[pr.hi - 1].float()
            else:
                vec = self._partial.pop(pr.seq_id)
                if kind == "mean":
                    vec = vec / pr.num_prompt
            vectors[pr.row] = finish_vector(vec, pr.params)
        if not vectors:
            return {}
        stacked = torch.stack(list(vectors.values())).cpu().tolist() if _same_width(vectors) else None
        if stacked is not None:
            return dict(zip(vectors, stacked))
        return {row: v.cpu().tolist() for row, v in vectors.items()}


def finish_vector(vec: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Truncate to ``dimensions`` (if set), then L2-normalise (if ``normalize``)."""
    if params.dimensions is not None:
        vec = vec[: params.dimensions]
    if params.normalize:
        vec = torch.nn.functional.normalize(vec, dim=0)
    return vec


def _same_width(vectors: dict[int, torch.Tensor]) -> bool:
    return len({v.shape[0] for v in vectors.values()}) == 1
