"""The runner's persistent batch: one row per live request, changed only by applying each step's message.

A row holds the request's token ids (prompt, then output), how many it has, how many are computed,
its block-table row, and its sampling parameters; the step's inputs are filled from these arrays
alone (:mod:`corerun.runner.step_inputs`), and the sampling metadata reads the rows' prompt and
output through views (:class:`Tokens`), without a copy.  :meth:`InputBatch.apply` takes a
:class:`~corerun.core.batch.ScheduledBatch` (requests gone, new or resumed ones in full, the others'
changes: tokens the runner did not sample, tables that changed, and every row's computed count as
one array write); :meth:`InputBatch.record` writes the tokens the runner sampled, which the
scheduler then does not send again (it appends the same tokens from the step's result).

The arrays grow by doubling: rows as requests arrive, columns as a request's tokens or blocks
outgrow them.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import Iterator

import numpy as np

from corerun.core.batch import NewRequest, ScheduledBatch
from corerun.sampling_params import SamplingParams


class Tokens(SequenceABC):
    """``array[start:end]`` of a row, read-only, without a copy (a step's prompt or output history)."""

    __slots__ = ("_a", "_start", "_end")

    def __init__(self, array: np.ndarray, start: int, end: int) -> None:
        self._a, self._start, self._end = array, start, end

    def __len__(self) -> int:
        return self._end - self._start

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return self._a[self._start : self._end][i].tolist()
        n = self._end - self._start
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("token index out of range")
        return int(self._a[self._start + i])

    def __iter__(self) -> Iterator[int]:
        return iter(self._a[self._start : self._end].tolist())


class RowView:
    """One row as the sampling side reads it: ``seq_id``, ``params``, ``prompt_token_ids`` and ``output_view()``
    (what logits processors and draft verification take)."""

    __slots__ = ("seq_id", "params", "prompt_token_ids", "_output")

    def __init__(self, seq_id: int, params: SamplingParams, prompt: Tokens, output: Tokens) -> None:
        self.seq_id, self.params, self.prompt_token_ids, self._output = seq_id, params, prompt, output

    def output_view(self) -> Tokens:
        return self._output


class InputBatch:
    """The live requests of a runner with KV-cache blocks of ``block_size`` tokens; see the module docstring."""

    def __init__(self, block_size: int, *, rows: int = 8, width: int = 256, table_width: int = 16) -> None:
        self.block_size = block_size
        self.index: dict[int, int] = {}  # seq_id -> its row
        self.seq_ids: list[int] = [-1] * rows
        self.params: list[SamplingParams | None] = [None] * rows
        self.token_ids = np.zeros((rows, width), dtype=np.int64)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.num_prompt = np.zeros(rows, dtype=np.int64)
        self.num_computed = np.zeros(rows, dtype=np.int64)
        self.block_table = np.zeros((rows, table_width), dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.prompt_logprobs_from = np.zeros(rows, dtype=np.int64)  # first prompt position still owed a logprob
        self.lora_slot = np.full(rows, -1, dtype=np.int32)  # the request's LoRA adapter slot; -1: the base model
        self._free = list(range(rows - 1, -1, -1))
        # live requests that need host work beyond the step's arrays (none: that work is skipped)
        self.pooling_ids: set[int] = set()  # embedding requests (params.pooling)
        self.prompt_logprob_ids: set[int] = set()  # requests asking for prompt logprobs
        self.table_writes: list[int] = []  # rows whose block-table row (or request) changed, for the step builder
        self._moves = 0  # requests added or removed so far: while it stays, a request keeps its row
        self._last_rows: tuple[tuple[int, ...], int, np.ndarray] = ((), -1, np.zeros(0, dtype=np.int64))  # rows_of's last answer

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.index

    # ----------------------------------------------------------------- apply
    def apply(self, batch: ScheduledBatch) -> np.ndarray:
        """Drop the finished and preempted requests, add the new and resumed ones, write the others'
        changes (a few rows a step), then every row's computed count at once.

        Returns the rows of ``batch.req_ids`` (int64 ``[R]``).  Raises ``ValueError`` naming a request
        the batch treats as held that has no row.
        """
        for sid in batch.finished_ids:
            self.remove(sid)
        for sid in batch.preempted_ids:
            self.remove(sid)
        for r in batch.new_reqs:
            self._add(r)
        for sid, t in batch.new_tokens.items():
            row = self._held(sid, "new_tokens")
            self._write_tokens(row, t.start, t.ids)
            self.num_tokens[row] = t.num_tokens
        for sid, change in batch.block_changes.items():
            self._write_blocks(self._held(sid, "block_changes"), change.start, change.ids)
        rows = self.rows_of(batch.req_ids)
        if batch.num_computed:
            if len(batch.num_computed) != len(rows):
                raise ValueError(f"the batch gives {len(batch.num_computed)} computed counts for {len(rows)} rows; "
                                 "num_computed holds one per request of req_ids")
            self.num_computed[rows] = batch.num_computed
        elif len(batch.new_reqs) < len(rows):
            raise ValueError("the batch schedules requests the runner already holds but gives no computed counts; "
                             "num_computed holds one per request of req_ids (empty only when every request is new)")
        return rows

    def _add(self, r: NewRequest) -> None:
        """A new or resumed request in a row of its own (replacing what the batch held of it, if anything)."""
        self.remove(r.seq_id)
        row = self._take()
        self.index[r.seq_id], self.seq_ids[row], self.params[row] = row, r.seq_id, r.params
        self._moves += 1
        if r.params.pooling is not None:
            self.pooling_ids.add(r.seq_id)
        if r.params.prompt_logprobs is not None:
            self.prompt_logprob_ids.add(r.seq_id)
        p, tokens = len(r.prompt_token_ids), r.prompt_token_ids + r.output_token_ids
        self._write_tokens(row, 0, tokens)
        self.num_tokens[row], self.num_prompt[row], self.num_computed[row] = len(tokens), p, r.num_computed_tokens
        self.num_blocks[row] = 0
        self._write_blocks(row, 0, r.block_ids)
        self.prompt_logprobs_from[row] = max(r.num_prompt_logprobs - 1, 0)
        self.lora_slot[row] = r.lora_slot

    def _held(self, seq_id: int, field: str) -> int:
        row = self.index.get(seq_id)
        if row is None:
            raise ValueError(f"request {seq_id} is sent as a change ({field}) but the runner holds no row for it; "
                             "a request the runner has not seen must come in new_reqs")
        return row

    def remove(self, seq_id: int) -> None:
        row = self.index.pop(seq_id, None)
        if row is not None:
            self.seq_ids[row], self.params[row] = -1, None
            self.pooling_ids.discard(seq_id)
            self.prompt_logprob_ids.discard(seq_id)
            self.block_table[row, : self.num_blocks[row]] = 0  # a free row's table is all zeros
            self.table_writes.append(row)
            self.num_blocks[row] = self.num_tokens[row] = 0
            self._free.append(row)
            self._moves += 1

    def record(self, row: int, tokens: list[int]) -> None:
        """The tokens the runner sampled for ``row`` after its last one (accepted drafts included)."""
        n = int(self.num_tokens[row])
        self._write_tokens(row, n, tokens)
        self.num_tokens[row] = n + len(tokens)

    def write_drafts(self, row: int, drafts: tuple[int, ...]) -> None:
        """A step's draft tokens after ``row``'s last token (inputs of that step only: not counted)."""
        self._write_tokens(row, int(self.num_tokens[row]), drafts)

    # ---------------------------------------------------------------- reads
    def rows_of(self, seq_ids: tuple[int, ...]) -> np.ndarray:
        """The rows of ``seq_ids``, int64, read-only; ``ValueError`` naming one without a row.  The same
        requests as the last call, none added or removed since (a steady batch of decodes): the same array."""
        last_ids, moves, rows = self._last_rows
        if moves == self._moves and seq_ids == last_ids:
            return rows
        try:
            rows = np.fromiter(map(self.index.__getitem__, seq_ids), dtype=np.int64, count=len(seq_ids))
        except KeyError as exc:
            raise ValueError(f"request {exc.args[0]} is scheduled but the runner holds no row for it (it was never "
                             "sent in new_reqs, or it finished)") from None
        rows.flags.writeable = False
        self._last_rows = (seq_ids, self._moves, rows)
        return rows

    def view(self, row: int) -> RowView:
        p, n = int(self.num_prompt[row]), int(self.num_tokens[row])
        tokens = self.token_ids[row]
        return RowView(self.seq_ids[row], self.params[row], Tokens(tokens, 0, p), Tokens(tokens, p, n))  # type: ignore[arg-type]

    def snapshot(self) -> dict[int, tuple[int, tuple[int, ...], int, int, tuple[int, ...]]]:
        """Every live request as plain values: seq_id -> (row, token ids, prompt length, computed count,
        block table); two batches fed the same messages give equal snapshots (tensor-parallel ranks)."""
        return {
            sid: (row, tuple(self.token_ids[row, : self.num_tokens[row]].tolist()), int(self.num_prompt[row]),
                  int(self.num_computed[row]), tuple(self.block_table[row, : self.num_blocks[row]].tolist()))
            for sid, row in self.index.items()
        }

    def blocks(self, seq_id: int) -> list[int]:
        """``seq_id``'s block table as held (empty without a row)."""
        row = self.index.get(seq_id)
        return [] if row is None else self.block_table[row, : self.num_blocks[row]].tolist()

    def tokens(self, seq_id: int) -> list[int]:
        """``seq_id``'s token ids as held (empty without a row)."""
        row = self.index.get(seq_id)
        return [] if row is None else self.token_ids[row, : self.num_tokens[row]].tolist()

    # ---------------------------------------------------------------- storage
    def _take(self) -> int:
        if not self._free:
            old = len(self.seq_ids)
            self._grow(2 * old, self.token_ids.shape[1], self.block_table.shape[1])
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def _write_tokens(self, row: int, start: int, tokens: tuple[int, ...] | list[int]) -> None:
        end = start + len(tokens)
        if end > self.token_ids.shape[1]:
            self._grow(len(self.seq_ids), max(end, 2 * self.token_ids.shape[1]), self.block_table.shape[1])
        if len(tokens) > 64:  # (a long run converts faster through fromiter than in the slice assignment)
            self.token_ids[row, start:end] = np.fromiter(tokens, dtype=np.int64, count=len(tokens))
        elif tokens:
            self.token_ids[row, start:end] = tokens

    def _write_blocks(self, row: int, start: int, ids: tuple[int, ...]) -> None:
        """``table[row][start:] = ids``; entries past the new end are zeroed."""
        held = int(self.num_blocks[row])
        if start > held:
            raise ValueError(f"request {self.seq_ids[row]}'s block-table change starts at {start} but its table holds "
                             f"{held} blocks; a change starts at most at the table's length")
        end = start + len(ids)
        if end > self.block_table.shape[1]:
            self._grow(len(self.seq_ids), self.token_ids.shape[1], max(end, 2 * self.block_table.shape[1]))
        if ids:
            self.block_table[row, start:end] = ids
        if held > end:
            self.block_table[row, end:held] = 0
        self.num_blocks[row] = end
        self.table_writes.append(row)

    def _grow(self, rows: int, width: int, table_width: int) -> None:
        old = len(self.seq_ids)
        self.seq_ids += [-1] * (rows - old)
        self.params += [None] * (rows - old)
        self.token_ids = _resized(self.token_ids, (rows, width))
        self.block_table = _resized(self.block_table, (rows, table_width))
        for name in ("num_tokens", "num_prompt", "num_computed", "num_blocks", "prompt_logprobs_from", "lora_slot"):
            setattr(self, name, _resized(getattr(self, name), (rows,)))


def _resized(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(shape, dtype=a.dtype)
    out[tuple(slice(0, n) for n in a.shape)] = a
    return out
