"""A step's model inputs, filled from the runner's persistent batch into a host staging buffer and
copied to the device once.

:class:`StepInputs` flattens a :class:`ScheduledBatch`, read against the rows of the runner's
:class:`~corerun.runner.input_batch.InputBatch` (token ids, computed counts, block tables), into
:class:`ModelInputs` (the fields of :data:`~corerun.protocols.step_layout.STEP_FIELDS`: token ids,
positions, slot mapping, query start locations, sequence and context lengths, block tables) and the
rows to sample with their logits indices.  Every field is written in place into a host buffer,
allocated once from the scheduler's limits (pinned on CUDA), in the field order and alignment of
:class:`~corerun.protocols.step_layout.StepLayout` (``T`` tokens, ``R`` requests, block tables ``W``
wide, each field starting on a 16-byte boundary)::

    input_ids | positions | slot_mapping                        int64 [T] each
    query_start_loc | seq_lens | context_lens | block_tables    int32 [R + 1], [R], [R], [R, W]
    lora_slots                                                  int32 [T]

There are two such buffers, and steps alternate between them: step ``N + 1`` is filled while step
``N`` may still run (asynchronous scheduling keeps one step in flight), and step ``N + 2``, which
reuses ``N``'s buffer, is built only after ``N``'s result was taken.  So a step's inputs hold until
the build after the next one, with no reference counting and no copy on CPU, where the tensors
handed out are views of the buffer (made once per buffer and layout).  On CUDA the used part of the
buffer is copied into a fresh device tensor without waiting (``non_blocking``), the fields being
views of it; before a buffer is written again, :meth:`_Staging.wait` waits for the copy out of it.
One fill writes the buffer (:meth:`StepInputs._fill`): vectorised numpy gathers from the persistent
batch, a fixed dozen calls whatever the step's size (fewer for a step of decodes only).  A step of a
few decodes (:attr:`StepInputs.small_batch`) is filled from Python lists instead, a few element reads
per request, as the fixed cost of those calls would exceed the whole step's work.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import numpy as np
import torch

from corerun.core.batch import ScheduledBatch
from corerun.protocols.graph import ModelInputs
from corerun.protocols.step_layout import StepLayout, StepTensors, model_inputs
from corerun.runner.input_batch import InputBatch


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


class _Staging:
    """One host staging buffer: its bytes, the fence after the last copy out of it (CUDA), the field
    views of each layout it has held (numpy arrays to fill, CPU tensors to hand out), and what its last
    step of decodes holds: the layout, the requests, and the rows whose tables changed since."""

    __slots__ = ("host", "host_np", "fence", "pending", "_views", "decodes", "stale", "row_at")

    def __init__(self, nbytes: int, pin: bool, fence: CopyFence | None) -> None:
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.fence, self.pending = fence, False
        self._views: dict[StepLayout, tuple[StepTensors, StepTensors]] = {}
        self.decodes: tuple[StepLayout, tuple[int, ...]] | None = None
        self.stale: set[int] = set()
        self.row_at: tuple[np.ndarray, dict[int, int]] | None = None  # the decodes' rows, and each one's index in them

    def wait(self) -> None:
        """Block until the copy out of this buffer has finished (it was queued steps ago)."""
        if self.pending:
            self.fence.synchronize()  # type: ignore[union-attr]
            self.pending = False

    def views(self, lay: StepLayout) -> tuple[StepTensors, StepTensors]:
        """The fields of ``lay`` in this buffer, as numpy arrays and as CPU tensors sharing their memory."""
        v = self._views.get(lay)
        if v is None:
            if len(self._views) >= 16:  # (a steady batch uses one or two layouts)
                self._views.clear()
            arrays = lay.arrays(self.host_np)
            v = self._views[lay] = (arrays, StepTensors._make(map(torch.from_numpy, arrays)))
        return v


class StepInputs:
    """Builds each step's inputs for a runner with KV-cache blocks of ``block_size`` tokens on ``device``.

    The staging buffers are sized for ``max_num_tokens`` tokens and ``max_num_reqs`` requests of
    ``max_blocks_per_seq`` blocks (a larger step grows the one it fills).  ``in_flight``: the steps
    that may still read their inputs while the next is built (one under asynchronous scheduling, one
    per stage under pipeline parallelism); there are ``in_flight + 1`` buffers.  ``fences``, one per
    buffer, replace the CUDA events that guard their reuse; tests pass them on CPU, where copies are
    synchronous and none is needed.
    """

    small_batch = 16  # a step of up to this many requests: per-request values as Python lists (:meth:`_small_step`)

    def __init__(
        self,
        block_size: int,
        device: torch.device | str,
        *,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_seq: int,
        in_flight: int = 1,
        fences: tuple[CopyFence, ...] | None = None,
    ) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two (8, 16, 32, ...), got {block_size}")
        self.block_size = block_size
        self._shift = block_size.bit_length() - 1  # log2(block_size): a position's block is position >> _shift
        self.device = torch.device(device)
        self.pin_memory = self.device.type == "cuda"
        if fences is None:
            fences = tuple(CudaCopyFence(self.device) if self.pin_memory else None for _ in range(in_flight + 1))
        if len(fences) != in_flight + 1:
            raise ValueError(f"fences has {len(fences)} entries; in_flight={in_flight} needs one per buffer, {in_flight + 1}")
        nbytes = StepLayout.of(max_num_tokens, max_num_reqs, max_blocks_per_seq).nbytes
        self._buffers = [_Staging(nbytes, self.pin_memory, f) for f in fences]
        self._next = 0  # the buffer the next build fills
        self._arange = np.arange(max(max_num_tokens, max_num_reqs) + 1, dtype=np.int64)
        self._in_block = np.arange(block_size, dtype=np.int64)  # each slot's offset in its block

    @property
    def capacity(self) -> int:
        """Bytes of the smaller staging buffer."""
        return min(b.host_np.size for b in self._buffers)

    def _staging(self, nbytes: int) -> _Staging:
        """The buffer this build fills, free of any copy still reading it and at least ``nbytes`` long."""
        k = self._next
        self._next = (k + 1) % len(self._buffers)
        buf = self._buffers[k]
        buf.wait()
        if nbytes > buf.host_np.size:
            buf = self._buffers[k] = _Staging(max(nbytes, 2 * buf.host_np.size), self.pin_memory, buf.fence)
        return buf

    # ------------------------------------------------------------------ build
    def build(self, sched: ScheduledBatch, batch: InputBatch, rows: np.ndarray | None = None,
              ) -> tuple[ModelInputs, np.ndarray, np.ndarray]:
        """Flatten ``sched`` against ``batch`` (which has applied it, drafts written after each row's last
        token); ``rows``: the rows of ``sched.req_ids`` (``InputBatch.apply`` returns them).

        Raises ``ValueError`` naming a request scheduled no token, one the runner holds no row for, or
        one whose block table is too short for the step.

        Returns the model inputs, the sampled rows (int64 ``[S]``: indices into ``sched.req_ids`` of the
        requests whose scheduled tokens reach their last token) and their logits indices (int64
        ``[S]``: each such row's last token in the flat token dimension).
        """
        num_reqs = len(sched.req_ids)
        if num_reqs == 0:
            raise ValueError("cannot prepare inputs for an empty scheduled batch (no requests); schedule at least one")
        if rows is None:
            rows = batch.rows_of(sched.req_ids)
        if sched.num_decodes == num_reqs:  # one token per request
            if num_reqs <= self.small_batch:
                return self._small_decodes(sched, batch, rows)
            return self._decodes(sched, batch, rows)
        nums = sched.num_scheduled
        if min(nums) < 1:
            i = nums.index(min(nums))
            raise ValueError(
                f"request {sched.req_ids[i]} is scheduled {nums[i]} tokens; every scheduled request needs at "
                "least one (a KV-cache manager's get_computed_prefix must leave the last prompt token uncomputed)"
            )
        if num_reqs <= self.small_batch:
            return self._small_step(sched, batch, rows)
        query_lens = np.array(nums, dtype=np.int64)
        ctx = batch.num_computed[rows]
        reach = ctx + query_lens
        blocks = self._check_tables(sched, batch, rows, reach)
        lay = StepLayout.of(int(query_lens.sum()), num_reqs, max(int(blocks.max()), 1))
        buf, out, host = self._begin(lay, batch)
        buf.decodes = None
        sampled_rows, logits_indices = self._fill(out, lay, batch, rows, ctx, query_lens)
        return self._finish(buf, lay, host, int(query_lens.max()), int(reach.max()), sched.num_decodes), sampled_rows, logits_indices

    def _lists(self, sched: ScheduledBatch, batch: InputBatch, rows: np.ndarray) -> tuple[list[int], list[int], int]:
        """``rows``, their computed counts as lists and the step's block-table width, every table checked
        to cover the step (``ValueError`` naming the first that does not)."""
        rl = rows.tolist()
        ctx = batch.num_computed[rows].tolist()
        blocks = batch.num_blocks[rows].tolist()
        shift = self._shift
        for i, (c, n, b) in enumerate(zip(ctx, sched.num_scheduled, blocks)):
            if b << shift < c + n:
                raise _short_table(sched.req_ids[i], b, c + n, self.block_size)
        return rl, ctx, max(max(blocks), 1)

    def _small_step(self, sched: ScheduledBatch, batch: InputBatch, rows: np.ndarray,
                    ) -> tuple[ModelInputs, np.ndarray, np.ndarray]:
        """A step of at most :attr:`small_batch` requests, some of more than one token: the per-request
        values and the decodes' tokens as Python lists, each longer run of tokens (a prompt chunk, a
        decode with drafts) copied as slices of its row."""
        rl, ctx, width = self._lists(sched, batch, rows)
        nums, d = sched.num_scheduled, sched.num_decodes
        starts = list(itertools.accumulate(nums, initial=0))
        seq_lens = [c + n for c, n in zip(ctx, nums)]
        lay = StepLayout.of(starts[-1], len(rl), width)
        buf, out, host = self._begin(lay, batch)
        buf.decodes = None
        if max(seq_lens) > self._arange.size:
            self._arange = np.arange(2 * max(seq_lens), dtype=np.int64)
        out.query_start_loc[:] = starts
        out.seq_lens[:] = seq_lens
        out.context_lens[:] = ctx
        out.block_tables[:] = batch.block_table[rows, : lay.table_width]
        tokens, table, lora = batch.token_ids, batch.block_table, batch.lora_slot.item
        if d:
            self._decode_tokens(out, batch, rl[:d], ctx[:d])
            out.lora_slots[:d] = [lora(r) for r in rl[:d]]
        shift = self._shift
        for r, c, n, s in zip(rl[d:], ctx[d:], nums[d:], starts[d:]):
            e, b = s + n, c >> shift  # its tokens go to [s, e) of the step; the first lies in block b of its table
            out.input_ids[s:e] = tokens[r, c : c + n]
            out.positions[s:e] = self._arange[c : c + n]
            slots = (np.left_shift(table[r, b : ((c + n - 1) >> shift) + 1, None], shift, dtype=np.int64) + self._in_block).reshape(-1)
            out.slot_mapping[s:e] = slots[c - (b << shift) : c - (b << shift) + n]
            out.lora_slots[s:e] = lora(r)
        num_tokens = batch.num_tokens.item
        sampled = [i for i, (r, n) in enumerate(zip(rl, seq_lens)) if n >= num_tokens(r)]
        inputs = self._finish(buf, lay, host, max(nums), max(seq_lens), d)
        return inputs, np.array(sampled, dtype=np.int64), np.array([starts[i + 1] - 1 for i in sampled], dtype=np.int64)

    def _decode_tokens(self, out: StepTensors, batch: InputBatch, rows: list[int], ctx: list[int]) -> None:
        """The step's first ``len(rows)`` tokens, one per request at its computed count: token ids, positions
        and slots written from Python lists."""
        tok, table, mask, shift = batch.token_ids.item, batch.block_table.item, self.block_size - 1, self._shift
        d = len(rows)
        out.input_ids[:d] = [tok(r, c) for r, c in zip(rows, ctx)]
        out.positions[:d] = ctx
        out.slot_mapping[:d] = [table(r, c >> shift) << shift | c & mask for r, c in zip(rows, ctx)]

    def _check_tables(self, sched: ScheduledBatch, batch: InputBatch, rows: np.ndarray, reach: np.ndarray) -> np.ndarray:
        """The block counts of ``rows``; ``ValueError`` naming the first whose table holds fewer than ``reach`` tokens."""
        blocks = batch.num_blocks[rows]
        short = np.flatnonzero(blocks * self.block_size < reach)
        if short.size:
            i = int(short[0])
            raise _short_table(sched.req_ids[i], int(blocks[i]), int(reach[i]), self.block_size)
        return blocks

    def _begin(self, lay: StepLayout, batch: InputBatch) -> tuple[_Staging, StepTensors, StepTensors]:
        """The buffer this build fills, with the fields of ``lay`` in it (numpy arrays to write, CPU tensors to hand out)."""
        buf = self._staging(lay.nbytes)
        if max(lay.num_tokens, lay.num_reqs) >= self._arange.size:
            self._arange = np.arange(2 * max(lay.num_tokens, lay.num_reqs) + 1, dtype=np.int64)
        if batch.table_writes:  # (rows whose tables every buffer must write again)
            for b in self._buffers:
                b.stale.update(batch.table_writes)
            batch.table_writes.clear()
        out, host = buf.views(lay)
        return buf, out, host

    def _finish(self, buf: _Staging, lay: StepLayout, host: StepTensors, max_query_len: int, max_seq_len: int,
                num_decodes: int) -> ModelInputs:
        """The filled buffer handed out: its own views on CPU, a device copy queued on CUDA."""
        buf.stale.clear()
        if self.pin_memory:  # one copy, queued; the buffer's fence tells the build after next when it is free
            staged = torch.empty(lay.nbytes, dtype=torch.uint8, device=self.device)
            staged.copy_(buf.host[: lay.nbytes], non_blocking=True)
            fields = lay.tensors(staged)
        else:  # the buffer's own views: they hold until the build after the next one
            fields = host
        if buf.fence is not None:
            buf.fence.record()
            buf.pending = True
        return model_inputs(
            fields,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            num_decodes=num_decodes,
            query_start_loc_cpu=host.query_start_loc,
            seq_lens_cpu=host.seq_lens,
        )

    def _decode_tables(self, buf: _Staging, out: StepTensors, lay: StepLayout, batch: InputBatch, req_ids: tuple[int, ...],
                       rows: np.ndarray) -> None:
        """A step of decodes' query starts, block tables and adapter slots.  When this buffer's last step was
        decodes of the same requests in the same layout, it holds them already but for the rows whose
        tables changed since, found through a map from row to index made once for the same ``rows``
        (``InputBatch.rows_of`` gives the same array while no request moved)."""
        if buf.decodes is not None and buf.decodes[0] is lay and buf.decodes[1] == req_ids:
            if buf.stale:
                if buf.row_at is None or buf.row_at[0] is not rows:
                    buf.row_at = (rows, {r: i for i, r in enumerate(rows.tolist())})
                row_at = buf.row_at[1]
                at = [row_at[r] for r in buf.stale if r in row_at]
                if len(at) > 8:
                    out.block_tables[at] = batch.block_table[rows[at], : lay.table_width]
                    out.lora_slots[at] = batch.lora_slot[rows[at]]
                else:  # (a few rows: copied one by one, for less than one gather's index arrays cost)
                    for i in at:
                        out.block_tables[i] = batch.block_table[rows[i], : lay.table_width]
                        out.lora_slots[i] = batch.lora_slot[rows[i]]
        else:
            out.query_start_loc[:] = self._arange[: lay.num_reqs + 1]
            np.take(batch.block_table[:, : lay.table_width], rows, axis=0, out=out.block_tables)
            np.take(batch.lora_slot, rows, out=out.lora_slots)
            buf.decodes = (lay, req_ids)

    def _small_decodes(self, sched: ScheduledBatch, batch: InputBatch, rows: np.ndarray,
                       ) -> tuple[ModelInputs, np.ndarray, np.ndarray]:
        """A step of at most :attr:`small_batch` decodes, its per-request values read and written as Python
        lists: a few element reads per request cost less than the two dozen numpy calls of :meth:`_decodes`."""
        rl, ctx, width = self._lists(sched, batch, rows)
        lay = StepLayout.of(len(rl), len(rl), width)
        buf, out, host = self._begin(lay, batch)
        self._decode_tables(buf, out, lay, batch, sched.req_ids, rows)
        self._decode_tokens(out, batch, rl, ctx)
        out.context_lens[:] = ctx
        seq_lens = [c + 1 for c in ctx]
        out.seq_lens[:] = seq_lens
        num_tokens = batch.num_tokens.item
        sampled_rows = np.array([i for i, (r, n) in enumerate(zip(rl, seq_lens)) if n >= num_tokens(r)], dtype=np.int64)
        return self._finish(buf, lay, host, 1, max(seq_lens), sched.num_decodes), sampled_rows, sampled_rows

    def _decodes(self, sched: ScheduledBatch, batch: InputBatch, rows: np.ndarray) -> tuple[ModelInputs, np.ndarray, np.ndarray]:
        """A step of decodes: one token per request at its computed count, vectorised."""
        ctx = batch.num_computed[rows]
        reach = ctx + 1
        blocks = self._check_tables(sched, batch, rows, reach)
        num_reqs = len(rows)
        lay = StepLayout.of(num_reqs, num_reqs, max(int(blocks.max()), 1))
        buf, out, host = self._begin(lay, batch)
        self._decode_tables(buf, out, lay, batch, sched.req_ids, rows)
        out.context_lens[:] = ctx
        out.positions[:] = ctx
        out.seq_lens[:] = reach
        out.input_ids[:] = batch.token_ids[rows, ctx]
        shift = self._shift
        block_ids = batch.block_table[rows, ctx >> shift]
        np.add(np.left_shift(block_ids, shift, dtype=np.int64), ctx & (self.block_size - 1), out=out.slot_mapping)
        sampled_rows = np.flatnonzero(reach >= batch.num_tokens[rows])  # (a one-token prompt chunk is not)
        return self._finish(buf, lay, host, 1, int(reach.max()), sched.num_decodes), sampled_rows, sampled_rows

    def _fill(
        self, out: StepTensors, lay: StepLayout, batch: InputBatch, rows: np.ndarray, ctx: np.ndarray, query_lens: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Write every element of the step's fields into the buffer; return (sampled_rows, logits_indices).

        Request ``i``'s tokens run from ``ctx[i]``: token ``j`` sits at position
        ``j - query_starts[i] + ctx[i]`` of row ``rows[i]``, and its slot is its block (from the row's
        table) times ``block_size`` plus the position within the block.  Token ids and blocks are read
        from the flattened arrays (one index per element: a gather with a row and a column index array
        costs twice as much).
        """
        query_starts, seq_lens, pos = out.query_start_loc, out.seq_lens, out.positions
        out.context_lens[:] = ctx
        query_starts[0] = 0
        np.cumsum(query_lens, out=query_starts[1:])
        np.add(ctx, query_lens, out=seq_lens)
        token_row = np.repeat(rows, query_lens)
        np.add(self._arange[: lay.num_tokens], np.repeat(ctx - query_starts[:-1], query_lens), out=pos)
        tokens, table = batch.token_ids, batch.block_table
        np.take(tokens.reshape(-1), token_row * tokens.shape[1] + pos, out=out.input_ids)
        out.block_tables[:] = table[rows, : lay.table_width]
        shift = self._shift
        blocks = table.reshape(-1).take(token_row * table.shape[1] + (pos >> shift))
        np.add(np.left_shift(blocks, shift, dtype=np.int64), pos & (self.block_size - 1), out=out.slot_mapping)
        out.lora_slots[:] = np.repeat(batch.lora_slot[rows], query_lens)
        # rows whose scheduled tokens reach their last token are sampled from that token's logits
        sampled_rows = np.flatnonzero(seq_lens >= batch.num_tokens[rows])
        return sampled_rows, query_starts[1:][sampled_rows].astype(np.int64) - 1


def _short_table(seq_id: int, num_blocks: int, num_tokens: int, block_size: int) -> ValueError:
    """The error for a block table too short for the step (a KV-cache manager broke its contract)."""
    need = -(-num_tokens // block_size)
    return ValueError(
        f"request {seq_id}'s block table has {num_blocks} blocks, but this step reaches {num_tokens} tokens, "
        f"which need {need} blocks of {block_size}; the KV-cache manager's allocate_slots must have grown it first"
    )
