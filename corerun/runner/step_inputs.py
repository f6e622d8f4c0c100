"""A step's model inputs, filled from the runner's persistent batch into one host staging buffer and
copied to the device once.

:class:`StepInputs` flattens a :class:`ScheduledBatch`, read against the rows of the runner's
:class:`~corerun.runner.input_batch.InputBatch` (token ids, computed counts, block tables), into
:class:`ModelInputs` (the fields of :data:`~corerun.protocols.step_layout.STEP_FIELDS`: token ids,
positions, slot mapping, query start locations, sequence and context lengths, block tables) and the
rows to sample with their logits indices.  Every field is written in place into one host buffer,
allocated once from the scheduler's limits (pinned on CUDA), in the field order and alignment of
:class:`~corerun.protocols.step_layout.StepLayout` (``T`` tokens, ``R`` requests, block tables ``W``
wide, each field starting on a 16-byte boundary)::

    input_ids | positions | slot_mapping                        int64 [T] each
    query_start_loc | seq_lens | context_lens | block_tables    int32 [R + 1], [R], [R], [R, W]
    lora_slots                                                  int32 [T]

Then one copy per step: on CUDA, of the used part of the pinned buffer into a fresh device tensor,
queued without waiting (``non_blocking``), the fields being views of that tensor
(:meth:`StepLayout.tensors`); on CPU, into a fresh host array whose views are the tensors.  Either
way nothing a step hands out is the staging buffer itself.  Reuse of the staging buffer is guarded
as :meth:`StepInputs._wait_for_copy` says.  One fill writes the buffer (:meth:`StepInputs._fill`):
vectorised numpy gathers from the persistent batch, a fixed dozen calls whatever the step's size.
"""

from __future__ import annotations

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


class StepInputs:
    """Builds each step's inputs for a runner with KV-cache blocks of ``block_size`` tokens on ``device``.

    The staging buffer is sized for ``max_num_tokens`` tokens and ``max_num_reqs`` requests of
    ``max_blocks_per_seq`` blocks (a larger step grows it).  ``fence`` replaces the CUDA event that
    guards the buffer's reuse; tests pass one on CPU, where copies are synchronous and none is needed.
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
        self.device = torch.device(device)
        self.pin_memory = self.device.type == "cuda"
        self._fence = fence if fence is not None else (CudaCopyFence(self.device) if self.pin_memory else None)
        self._copy_pending = False
        self._host = torch.empty(0, dtype=torch.uint8)
        self._host_np = self._host.numpy()
        self._arange = np.arange(max_num_tokens, dtype=np.int64)
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
    def build(self, sched: ScheduledBatch, batch: InputBatch) -> tuple[ModelInputs, np.ndarray, np.ndarray]:
        """Flatten ``sched`` against ``batch`` (which has applied it, drafts written after each row's last token).

        Raises ``ValueError`` naming a request scheduled no token, one the runner holds no row for, or
        one whose block table is too short for the step.

        Returns the model inputs, the sampled rows (int64 ``[S]``: indices into ``sched.req_ids`` of the
        requests whose scheduled tokens reach their last token) and their logits indices (int64
        ``[S]``: each such row's last token in the flat token dimension).
        """
        num_reqs = len(sched.req_ids)
        if num_reqs == 0:
            raise ValueError("cannot prepare inputs for an empty scheduled batch (no requests); schedule at least one")
        rows = batch.rows_of(sched.req_ids)
        query_lens = np.array(sched.num_scheduled, dtype=np.int64)
        if query_lens.min() < 1:
            i = int(query_lens.argmin())
            raise ValueError(
                f"request {sched.req_ids[i]} is scheduled {query_lens[i]} tokens; every scheduled request needs at "
                "least one (a KV-cache manager's get_computed_prefix must leave the last prompt token uncomputed)"
            )
        ctx = batch.num_computed[rows]
        reach = ctx + query_lens
        blocks = batch.num_blocks[rows]
        short = np.flatnonzero(blocks * self.block_size < reach)
        if short.size:
            i = int(short[0])
            raise _short_table(sched.req_ids[i], int(blocks[i]), int(reach[i]), self.block_size)
        num_tokens = int(reach.sum() - ctx.sum())
        lay = StepLayout.of(num_tokens, num_reqs, max(int(blocks.max()), 1))
        self._wait_for_copy()
        if lay.nbytes > self._host_np.size:
            self._grow(lay.nbytes)
        out = lay.arrays(self._host_np)
        sampled_rows, logits_indices = self._fill(out, lay, batch, rows, ctx, query_lens)

        decode = sched.num_decodes == num_reqs
        if self.pin_memory:  # one copy, queued; the fence tells the next build when the buffer is free
            staged = torch.empty(lay.nbytes, dtype=torch.uint8, device=self.device)
            staged.copy_(self._host[: lay.nbytes], non_blocking=True)
            self._fence.record()  # type: ignore[union-attr]
            self._copy_pending = True
            fields = lay.tensors(staged)
            qsl_cpu, seq_lens_cpu = torch.from_numpy(out.query_start_loc.copy()), torch.from_numpy(out.seq_lens.copy())
        else:  # a fresh host copy: the tensors handed out are views of it
            if self._fence is not None:  # (a test's fence on CPU)
                self._fence.record()
                self._copy_pending = True
            fields = lay.host_tensors(self._host_np[: lay.nbytes].copy())
            qsl_cpu, seq_lens_cpu = fields.query_start_loc, fields.seq_lens
        inputs = model_inputs(
            fields,
            max_query_len=1 if decode else int(query_lens.max()),
            max_seq_len=int(reach.max()),
            num_decodes=sched.num_decodes,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        return inputs, sampled_rows, logits_indices

    def _fill(
        self, out: StepTensors, lay: StepLayout, batch: InputBatch, rows: np.ndarray, ctx: np.ndarray, query_lens: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Write every element of the step's fields into the buffer; return (sampled_rows, logits_indices).

        Request ``i``'s tokens run from ``ctx[i]``: token ``j`` sits at position
        ``j - query_starts[i] + ctx[i]`` of row ``rows[i]``, and its slot is its block (from the row's
        table) times ``block_size`` plus the position within the block.
        """
        num_tokens = lay.num_tokens
        if num_tokens > self._arange.size:
            self._arange = np.arange(2 * num_tokens, dtype=np.int64)
        query_starts, seq_lens, positions = out.query_start_loc, out.seq_lens, out.positions
        out.context_lens[:] = ctx
        query_starts[0] = 0
        np.cumsum(query_lens, out=query_starts[1:])
        np.add(ctx, query_lens, out=seq_lens)
        token_row = np.repeat(rows, query_lens)
        pos = self._arange[:num_tokens] + np.repeat(ctx - query_starts[:-1], query_lens)
        positions[:] = pos
        out.input_ids[:] = batch.token_ids[token_row, pos]
        out.block_tables[:] = batch.block_table[rows, : lay.table_width]
        shift = self.block_size.bit_length() - 1
        blocks = batch.block_table[token_row, pos >> shift].astype(np.int64)
        np.add(blocks << shift, pos & (self.block_size - 1), out=out.slot_mapping)
        out.lora_slots[:] = batch.lora_slot[token_row]
        # rows whose scheduled tokens reach their last token are sampled from that token's logits
        sampled_rows = np.flatnonzero(seq_lens >= batch.num_tokens[rows])
        logits_indices = query_starts[1:][sampled_rows].astype(np.int64) - 1
        return sampled_rows, logits_indices


def _short_table(seq_id: int, num_blocks: int, num_tokens: int, block_size: int) -> ValueError:
    """The error for a block table too short for the step (a KV-cache manager broke its contract)."""
    need = -(-num_tokens // block_size)
    return ValueError(
        f"request {seq_id}'s block table has {num_blocks} blocks, but this step reaches {num_tokens} tokens, "
        f"which need {need} blocks of {block_size}; the KV-cache manager's allocate_slots must have grown it first"
    )
