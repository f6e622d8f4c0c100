"""A step's model inputs, written into one persistent host staging buffer and copied to the device once.

:class:`StepInputs` flattens a :class:`ScheduledBatch` into :class:`ModelInputs` (the fields of
:data:`~corerun.protocols.step_layout.STEP_FIELDS`: token ids, positions, slot mapping, query start
locations, sequence and context lengths, block tables) and the rows to sample with their logits
indices.  Every field is written in place into one host buffer, allocated once from the scheduler's
limits (pinned on CUDA), in the field order and alignment of
:class:`~corerun.protocols.step_layout.StepLayout` (``T`` tokens, ``R`` requests, block tables ``W``
wide, each field starting on a 16-byte boundary)::

    input_ids | positions | slot_mapping                        int64 [T] each
    query_start_loc | seq_lens | context_lens | block_tables    int32 [R + 1], [R], [R], [R, W]

Then one copy per step: on CUDA, of the used part of the pinned buffer into a fresh device tensor,
queued without waiting (``non_blocking``), the fields being views of that tensor
(:meth:`StepLayout.tensors`); on CPU, into a host copy whose views are the tensors, an earlier
step's copy of the same layout when nothing holds any of its tensors or a view of them any more
(:class:`_HostCopy`: making seven tensors costs more than the rest of a small step).  Either way
nothing a step hands out is the staging buffer itself, and nothing is overwritten while it can
still be read.  Reuse of the staging buffer is guarded as :meth:`StepInputs._wait_for_copy` says.

One fill writes the buffer (:meth:`StepInputs._fill`): vectorised numpy with few calls, whatever
the step's size; what a steady batch leaves unchanged since the previous step (the query starts of
a decode, the block tables of the same rows) it does not write again.

Block tables cost per step what is new in them, not their length: :class:`BlockRows` keeps each
sequence's table across steps as an int32 row of one persistent table and applies the changes the
scheduler states in each batch (``ScheduledBatch.new_block_ids``, ``finished_ids``; protocol version
2); the step's ``[R, W]`` field is one gather of those rows, or, for the same rows as the step
before, a copy of the rows written since (:meth:`BlockRows.written_since`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Protocol, Sequence as SequenceT

import numpy as np
import torch

from corerun.core.scheduler import BlockIds, ScheduledBatch
from corerun.core.sequence import Sequence
from corerun.protocols.graph import ModelInputs
from corerun.protocols.step_layout import StepLayout, StepTensors, model_inputs


class CopyFence(Protocol):
    """Marks the point in the device stream after a step's copy; ``synchronize`` waits for it."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...


class CudaCopyFence:
    """A CUDA event recorded on ``device``'s current stream, where the step's copy was queued."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._event = torch.cuda.Event()

    def record(self) -> None:
        self._event.record(torch.cuda.current_stream(self._device))

    def synchronize(self) -> None:
        self._event.synchronize()


@dataclass(slots=True, eq=False)
class BlockRow:
    """One sequence's block table as :class:`BlockRows` holds it: row ``slot`` of ``BlockRows.table``,
    its first ``num_blocks`` entries; ``seen`` is the last build that used the row."""

    seq_id: int
    slot: int
    num_blocks: int
    seen: int


class BlockRows:
    """The block tables of live sequences, kept across steps as rows of one int32 table.

    ``table`` is int32 ``[slots, width]``, each row zero past its sequence's ``num_blocks`` (so rows
    gathered at any width come zero-padded).  The rows follow the changes the scheduler states
    (protocol version 2, :class:`~corerun.core.scheduler.ScheduledBatch`): :meth:`apply` frees the
    rows of finished sequences and writes each ``BlockIds`` change (``row[start:] = ids``: appended
    blocks, a whole new table after a preemption, a trim), so a step copies only what is new and
    never reads a whole table from the KV-cache manager to find out what changed.

    :meth:`rows_for` reads a table with ``block_table`` only where no change could have said it: a
    sequence without a row (a batch built by hand, or a row given up for room) or whose row is too
    short for the step (a change the runner never saw); :attr:`reads` counts those reads.

    Bounded: ``width`` doubles when a table outgrows it, and ``slots`` rows at most (``StepInputs``
    gives 2 x ``max_num_reqs``, at least 64; doubled only when one step has more sequences).  A new
    sequence that finds no free row gives up the older half (least recently used first) of the rows
    no sequence of the current step uses; a row given up is read again if its sequence returns.
    """

    def __init__(self, block_size: int, *, slots: int, width: int) -> None:
        self.block_size = block_size
        self._shift = block_size.bit_length() - 1  # block_size is a power of two
        self.table = np.zeros((max(slots, 1), max(width, 1)), dtype=np.int32)
        self._rows: dict[int, BlockRow] = {}  # seq_id -> its row
        self._free = list(range(self.table.shape[0] - 1, -1, -1))  # slots without a row, popped from the end
        self._step = 0
        self.reads = 0  # whole tables read with block_table (none while every change is applied)
        self.version = 0  # counts the writes to ``table``: a gather of the same rows redoes what was written since
        self._written: list[int] = []  # the slot of each write since version ``_logged_from`` (rows written since)
        self._logged_from = 0

    def __len__(self) -> int:
        """Sequences with a row."""
        return len(self._rows)

    def blocks(self, seq_id: int) -> list[int]:
        """``seq_id``'s row as a list (empty without a row)."""
        row = self._rows.get(seq_id)
        return [] if row is None else self.table[row.slot, : row.num_blocks].tolist()

    def apply(self, finished_ids: Iterable[int], changes: Mapping[int, BlockIds]) -> None:
        """Free the rows of ``finished_ids``, then write each change (``ScheduledBatch.new_block_ids``).

        A change that starts past what the row holds (or with no row, past 0) cannot be applied: the
        row is dropped, and :meth:`rows_for` reads the whole table when the sequence is next used.
        """
        for seq_id in finished_ids:
            self._drop(seq_id)
        for seq_id, (start, ids) in changes.items():
            row = self._rows.get(seq_id)
            if row is None and start == 0:
                row = self._rows[seq_id] = BlockRow(seq_id, self._take_slot(), 0, self._step)
            if row is None or start > row.num_blocks:
                self._drop(seq_id)
                continue
            self._write(row, start, ids)

    def rows_for(
        self, seqs: list[Sequence], ctx: list[int], num_new: list[int], block_table: Callable[[int], SequenceT[int]]
    ) -> list[BlockRow]:
        """The rows of ``seqs`` for a step computing ``num_new[i]`` tokens after ``ctx[i]``.

        Raises ``ValueError`` naming the first sequence whose table has fewer blocks than
        ``ceil((ctx[i] + num_new[i]) / block_size)``; whatever ``block_table`` raises propagates.
        """
        self._step = step = self._step + 1
        shift, get = self._shift, self._rows.get
        rows: list[BlockRow | None] = []
        unread: list[int] = []
        for s, c, n in zip(seqs, ctx, num_new):
            row = get(s.seq_id)
            if row is not None:
                row.seen = step  # in use: never given up to make room for another sequence of this step
                if row.num_blocks << shift >= c + n:
                    rows.append(row)
                    continue
            unread.append(len(rows))
            rows.append(row)
        for i in unread:
            rows[i] = self._read(seqs[i].seq_id, rows[i], ctx[i] + num_new[i], block_table)
        return rows  # type: ignore[return-value]

    def written_since(self, version: int) -> list[int] | None:
        """The slots written since ``version`` (repeats possible); ``None`` if no longer known (a resize, or long ago)."""
        if version < self._logged_from:
            return None
        return self._written[version - self._logged_from :]

    def gather(self, rows: list[BlockRow], out: np.ndarray) -> None:
        """Write ``rows`` into ``out`` (int32 ``[len(rows), W]``, W at least every row's ``num_blocks``), zero-padded."""
        table, w = self.table, out.shape[1]
        if len(rows) <= 4:  # a few slice copies cost less than one gather (its index array included)
            for i, row in enumerate(rows):
                out[i] = table[row.slot, :w]
        else:
            out[...] = table[np.array([row.slot for row in rows], dtype=np.intp), :w]

    def _read(self, seq_id: int, row: BlockRow | None, reach: int, block_table: Callable[[int], SequenceT[int]]) -> BlockRow:
        """Ask the manager for ``seq_id``'s whole table, refuse it if shorter than ``reach`` tokens, write the row."""
        fresh = block_table(seq_id)
        self.reads += 1
        if len(fresh) << self._shift < reach:
            raise _short_table(seq_id, len(fresh), reach, self.block_size)
        if row is None:
            row = self._rows[seq_id] = BlockRow(seq_id, self._take_slot(), 0, self._step)
        self._write(row, 0, fresh)
        return row

    def _write(self, row: BlockRow, start: int, ids: SequenceT[int]) -> None:
        """``row[start:] = ids``; entries past the new end are zeroed."""
        n = start + len(ids)
        if n > self.table.shape[1]:
            self._resize(self.table.shape[0], max(n, 2 * self.table.shape[1]))
        table, slot, held = self.table, row.slot, row.num_blocks
        self.version += 1
        if len(self._written) >= _WRITE_LOG:
            self._written.clear()
            self._logged_from = self.version - 1
        self._written.append(slot)
        if ids:
            table[slot, start:n] = ids
        if held > n:  # what the row held past its new end (a free slot is all zeros)
            table[slot, n:held] = 0
        row.num_blocks = n

    def _drop(self, seq_id: int) -> None:
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self.table[row.slot, : row.num_blocks] = 0  # a free slot is all zeros
            self._free.append(row.slot)

    def _take_slot(self) -> int:
        if not self._free:
            idle = sorted((row for row in self._rows.values() if row.seen < self._step), key=lambda row: row.seen)
            if idle:
                for row in idle[: (len(idle) + 1) // 2]:
                    self._drop(row.seq_id)
            else:  # every row belongs to this step's sequences
                slots = self.table.shape[0]
                self._resize(2 * slots, self.table.shape[1])
                self._free.extend(range(2 * slots - 1, slots - 1, -1))
        return self._free.pop()

    def _resize(self, slots: int, width: int) -> None:
        old = self.table
        self.version += 1
        self._written.clear()
        self._logged_from = self.version  # every row moved: a gather from before is redone whole
        self.table = np.zeros((slots, width), dtype=np.int32)
        self.table[: old.shape[0], : old.shape[1]] = old


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)  # tensors (views included) on a storage


class _HostCopy:
    """One CPU step's copy of the staging buffer and its fields, views of one storage (``root``).

    Reused for a later step of the same layout once nothing outside holds any of its fields or a view
    of them (:meth:`unused`): the same count of references to each field and to the storage as when
    it was made, so a step's tensors are never written while anything can still read them.
    """

    __slots__ = ("host", "fields", "_storage", "_counts")

    def __init__(self, lay: StepLayout) -> None:
        self.host = np.empty(lay.nbytes, dtype=np.uint8)
        root = torch.from_numpy(self.host)
        self.fields = lay.tensors(root)
        self._storage = root.untyped_storage()  # (held: counted in the use count both times)
        del root
        self._counts = self._references()

    def _references(self) -> tuple[int, ...]:
        getrefcount = sys.getrefcount
        return (_storage_use_count(self._storage._cdata), *[getrefcount(t) for t in self.fields])  # type: ignore[misc]

    def unused(self) -> bool:
        return self._references() == self._counts


@dataclass(slots=True, eq=False)
class _Staged:
    """What one layout's fill reuses from step to step while the layout and the staging buffer stay the same.

    ``fields``: the numpy views of the staging buffer a fill writes; ``table_flat``: the block-table
    field as one flat row; ``row_base``: int64 ``[R]``, each request's first entry in ``table_flat``.
    ``decode_starts``: ``query_start_loc`` holds ``0, 1, ..., R`` (written by a decode, kept by the next).
    ``rows`` / ``version``: the rows last gathered into the block-table field and ``BlockRows.version``
    then: for the same rows, only those written since need copying again (``row_at``: slot -> index).
    """

    layout: StepLayout
    host: np.ndarray
    fields: StepTensors
    table_flat: np.ndarray
    row_base: np.ndarray
    decode_starts: bool = False
    rows: list[BlockRow] | None = None
    version: int = -1
    row_at: dict[int, int] | None = None
    copies: list[_HostCopy] | None = None  # CPU: StepInputs._copies[layout], looked up once

    @classmethod
    def of(cls, lay: StepLayout, host: np.ndarray) -> _Staged:
        fields = lay.arrays(host)
        width = lay.table_width
        return cls(lay, host, fields, fields.block_tables.reshape(-1), np.arange(lay.num_reqs, dtype=np.int64) * width)


class StepInputs:
    """Builds each step's inputs for a runner with KV-cache blocks of ``block_size`` tokens on ``device``.

    The staging buffer is sized for ``max_num_tokens`` tokens and ``max_num_reqs`` requests of
    ``max_blocks_per_seq`` blocks (a larger step grows it).  ``fence`` replaces the CUDA event that
    guards the buffer's reuse; tests pass one on CPU, where copies are synchronous and none is needed.
    Block tables are kept across steps in :attr:`block_rows` (see :class:`BlockRows`): every
    ``build`` must be given the same KV-cache manager's ``block_table``.
    """

    def __init__(
        self,
        block_size: int,
        device: torch.device | str,
        *,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_seq: int,
        fence: CopyFence | None = None,
    ) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two (8, 16, 32, ...), got {block_size}")
        self.block_size = block_size
        self._block_shift = block_size.bit_length() - 1
        # (one-element arrays: numpy handles a Python int operand in several times the time of an array)
        self._shift_np = np.array([self._block_shift], dtype=np.int64)
        self._block_size_np = np.array([block_size], dtype=np.int64)
        self.device = torch.device(device)
        self.pin_memory = self.device.type == "cuda"
        self._fence = fence if fence is not None else (CudaCopyFence(self.device) if self.pin_memory else None)
        self._copy_pending = False
        self._host = torch.empty(0, dtype=torch.uint8)
        self._host_np = self._host.numpy()
        self._staged: _Staged | None = None  # the last fill's layout, views and what they hold
        self._copies: dict[StepLayout, list[_HostCopy]] = {}  # CPU: recent layouts' copies, oldest first
        self._arange = np.arange(max_num_tokens, dtype=np.intp)
        self.block_rows = BlockRows(block_size, slots=max(2 * max_num_reqs, 64), width=min(max_blocks_per_seq, 64))
        self._grow(StepLayout.of(max_num_tokens, max_num_reqs, max_blocks_per_seq).nbytes)

    @property
    def capacity(self) -> int:
        """Bytes of the host staging buffer."""
        return self._host_np.size

    def _grow(self, nbytes: int) -> None:
        """A new staging buffer of at least ``nbytes`` (only ever called with no copy pending)."""
        self._host = torch.empty(max(nbytes, 2 * self._host_np.size), dtype=torch.uint8, pin_memory=self.pin_memory)
        self._host_np = self._host.numpy()

    def _wait_for_copy(self) -> None:
        """Block until the previous step's copy out of the staging buffer has finished.

        Invariant: the host buffer is written only when no queued copy still reads it.  ``build``
        records the fence on the device stream right after queuing its copy, and calls this before
        its first write.  The engine's one host sync per step (the sampled tokens' ``.tolist()``)
        usually means the fence passed long ago, but nothing relies on it: a step that samples no row
        (a prompt chunk that does not finish its prompt, a step that only computes prompt logprobs),
        a step whose forward or sampler raised, and a caller that prepares twice without running
        (benchmarks) all reach the next ``build`` without one.  The wait covers the copy and what the
        stream queued before it (at most the forward of the step before the previous one), never the
        forward queued after it.
        """
        if self._copy_pending:
            self._fence.synchronize()  # type: ignore[union-attr]
            self._copy_pending = False

    # ------------------------------------------------------------------ build
    def build(self, sched: ScheduledBatch, block_table: Callable[[int], list[int]]) -> tuple[ModelInputs, np.ndarray, np.ndarray]:
        """Flatten ``sched``; ``block_table(seq_id)`` gives a sequence's physical block ids.

        ``block_table`` is called only for a sequence without a row or whose row is too short for
        the step (a change the runner did not see, :class:`BlockRows`).
        Raises ``ValueError`` naming a sequence scheduled no token, or one whose block table is too
        short for the step.

        Returns the model inputs, the sampled rows (int64 ``[S]``: indices into ``sched.seqs`` of the
        sequences whose scheduled tokens reach their last token) and their logits indices (int64
        ``[S]``: each such row's last token in the flat token dimension).
        """
        seqs, num_new = sched.seqs, sched.num_new
        num_reqs = len(seqs)
        if num_reqs == 0:
            raise ValueError("cannot prepare inputs for an empty scheduled batch (no sequences); schedule at least one")
        if min(num_new) < 1:
            i = num_new.index(min(num_new))
            raise ValueError(
                f"sequence {seqs[i].seq_id} is scheduled {num_new[i]} tokens; every scheduled sequence needs at "
                "least one (a KV-cache manager's get_computed_prefix must leave the last prompt token uncomputed)"
            )
        # per-sequence host work, before waiting for the previous copy (it overlaps with the device)
        ctx = [s.num_computed_tokens for s in seqs]
        self.block_rows.apply(sched.finished_ids, sched.new_block_ids)
        rows = self.block_rows.rows_for(seqs, ctx, num_new, block_table)
        decode = sched.num_decodes == num_reqs  # one token per request
        if decode:
            num_tokens = num_reqs
            ids = [s.token_ids[c] for s, c in zip(seqs, ctx)]
        else:
            num_tokens = sum(num_new)
            ids = []
            for s, c, n in zip(seqs, ctx, num_new):
                ids += s.token_ids[c : c + n]
        lay = StepLayout.of(num_tokens, num_reqs, max([row.num_blocks for row in rows]))

        self._wait_for_copy()
        if lay.nbytes > self._host_np.size:
            self._grow(lay.nbytes)
        sampled_rows, logits_indices, max_seq_len = self._fill(lay, seqs, ids, ctx, num_new, rows, decode)

        if self.pin_memory:  # one copy, queued; the fence tells the next build when the buffer is free
            staged = torch.empty(lay.nbytes, dtype=torch.uint8, device=self.device)
            staged.copy_(self._host[: lay.nbytes], non_blocking=True)
            self._fence.record()  # type: ignore[union-attr]
            self._copy_pending = True
            fields = lay.tensors(staged)
            host = self._staged.fields  # type: ignore[union-attr]  (the views _fill wrote this step)
            qsl_cpu, seq_lens_cpu = torch.from_numpy(host.query_start_loc.copy()), torch.from_numpy(host.seq_lens.copy())
        else:  # a fresh numpy copy: the tensors handed out are views of it, host copies included
            if self._fence is not None:  # (a test's fence on CPU)
                self._fence.record()
                self._copy_pending = True
            fields = self._host_copy(lay)
            qsl_cpu, seq_lens_cpu = fields.query_start_loc, fields.seq_lens
        inputs = model_inputs(
            fields,
            max_query_len=1 if decode else max(num_new),
            max_seq_len=max_seq_len,
            num_decodes=sched.num_decodes,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        return inputs, sampled_rows, logits_indices

    def _host_copy(self, lay: StepLayout) -> StepTensors:
        """The staging buffer's used part copied to host tensors no earlier step's caller still holds.

        Copies are kept for the last few layouts (making one costs some ten torch calls, reusing one a
        reference count per field); without torch's storage use count, a fresh copy every step.
        """
        if _storage_use_count is None:
            return lay.host_tensors(self._host_np[: lay.nbytes].copy())
        st = self._staged  # (the fill's, of this layout)
        copies = st.copies  # type: ignore[union-attr]
        if copies is None:
            copies = self._copies.get(lay)
            if copies is None:
                if len(self._copies) >= _COPY_LAYOUTS:
                    del self._copies[next(iter(self._copies))]
                copies = self._copies[lay] = []
            st.copies = copies  # type: ignore[union-attr]
        for copy in copies:
            if copy.unused():
                break
        else:
            copy = _HostCopy(lay)
            copies.append(copy)
            if len(copies) > _COPIES_PER_LAYOUT:  # the oldest stays alive as long as its holders do
                del copies[0]
        np.copyto(copy.host, self._host_np[: lay.nbytes])
        return copy.fields

    def _fill(
        self, lay: StepLayout, seqs: list[Sequence], ids: list[int], ctx: list[int], num_new: list[int],
        rows: list[BlockRow], decode: bool,
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Write every element of the step's fields into the buffer; return (sampled_rows, logits_indices, max_seq_len).

        Vectorised numpy whatever the step's size: a fixed cost of about a dozen numpy calls, and per
        token far less than a Python loop.  What a steady batch leaves unchanged from the step before
        (same layout, same buffer) is not written again: the query starts of a decode, and of the
        block tables of the same rows all but those written since.  The gaps between fields
        keep old bytes (no field covers them).
        """
        st = self._staged
        if st is None or st.layout is not lay or st.host is not self._host_np:
            st = self._staged = _Staged.of(lay, self._host_np)
        out = st.fields
        num_tokens, num_reqs = lay.num_tokens, lay.num_reqs
        query_starts, seq_lens, positions, context_lens = out.query_start_loc, out.seq_lens, out.positions, out.context_lens
        context_lens[:] = ctx
        if decode:  # one token per request, at its context length
            if not st.decode_starts:
                query_starts[:] = np.arange(num_reqs + 1, dtype=np.int32)
                st.decode_starts = True
            np.add(context_lens, _ONE_INT32, out=seq_lens)
            positions[:] = context_lens
            token_base = st.row_base  # each token's request's first entry in the flat block tables
            max_seq_len = max(ctx) + 1
            out.input_ids[:] = ids
        else:  # request i's tokens run from ctx[i]: token j sits at j - query_starts[i] + ctx[i]
            if num_tokens > self._arange.size:
                self._arange = np.arange(2 * num_tokens, dtype=np.intp)
            st.decode_starts = False
            query_lens = np.array(num_new)
            query_starts[0] = 0
            np.add.accumulate(query_lens, out=query_starts[1:])
            np.add(context_lens, query_lens, out=seq_lens)
            np.add(self._arange[:num_tokens], np.repeat(context_lens - query_starts[:-1], query_lens), out=positions)
            token_base = np.repeat(st.row_base, query_lens)
            max_seq_len = int(seq_lens.max())
            out.input_ids[:] = np.fromiter(ids, dtype=np.int64, count=num_tokens)  # (faster than from a long list)
        block_rows = self.block_rows
        version = block_rows.version
        if st.version != version:  # the block tables: rows (zero-padded, each covering the step's tokens) copied from block_rows
            written = block_rows.written_since(st.version) if st.rows == rows else None  # (list equality: identities)
            if written is None or len(written) > len(rows) // 4:
                block_rows.gather(rows, out.block_tables)
                st.rows, st.row_at = rows, None
            else:  # the same rows as the step before: copy those written since
                if st.row_at is None:
                    st.row_at = {row.slot: i for i, row in enumerate(rows)}
                row_at, table, tables, w = st.row_at, block_rows.table, out.block_tables, lay.table_width
                for slot in written:
                    i = row_at.get(slot)
                    if i is not None:
                        tables[i] = table[slot, :w]
            st.version = version
        elif st.rows != rows:
            block_rows.gather(rows, out.block_tables)
            st.rows, st.row_at = rows, None
        # slot = block * block_size + position % block_size = (block - position // block_size) * block_size + position
        # (each operation into a new array or a field: numpy checks an output that is also an input for overlap)
        block_index = positions >> self._shift_np
        blocks_less_index = st.table_flat.take(token_base + block_index) - block_index  # int64
        np.add(blocks_less_index * self._block_size_np, positions, out=out.slot_mapping)
        # rows that finish their scheduled tokens are sampled from their last token's logits
        sampled_rows = np.equal(seq_lens, np.array([len(s.token_ids) for s in seqs], dtype=np.int32)).nonzero()[0]
        logits_indices = sampled_rows.copy() if decode else np.subtract(query_starts[1:][sampled_rows], 1, dtype=np.int64)
        return sampled_rows, logits_indices, max_seq_len


_ONE_INT32 = np.ones(1, dtype=np.int32)
_WRITE_LOG = 4096  # BlockRows: writes remembered (a step's gather needs those since the step before)
_COPY_LAYOUTS = 4  # CPU steps: layouts whose copies are kept
_COPIES_PER_LAYOUT = 3  # and copies per layout (a caller holding one step's inputs while the next is built needs two)


def _short_table(seq_id: int, num_blocks: int, num_tokens: int, block_size: int) -> ValueError:
    """The error for a block table too short for the step (a KV-cache manager broke its contract)."""
    need = -(-num_tokens // block_size)
    return ValueError(
        f"sequence {seq_id}'s block table has {num_blocks} blocks, but this step reaches {num_tokens} tokens, "
        f"which need {need} blocks of {block_size}; the KV-cache manager's allocate_slots must have grown it first"
    )
