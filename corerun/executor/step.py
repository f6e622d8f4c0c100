"""The commands rank 0 sends its workers, and a step's inputs packed into one tensor for them.

A step travels in two parts: a small :class:`StepHeader` on the command channel (host numbers,
shapes, and the host copies of ``query_start_loc`` / ``seq_lens``), then one int64 tensor broadcast
over the process group (device to device under NCCL) holding every per-token and per-request array:

    input_ids [T] | positions [T] | slot_mapping [T] | query_start_loc [R+1] | seq_lens [R] | context_lens [R] | block_tables [R*W]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from corerun.protocols.attention import AttentionBatch
from corerun.protocols.graph import ModelInputs


@dataclass(slots=True)
class StepHeader:
    """Run the model on the step whose packed inputs are broadcast next."""

    num_tokens: int
    num_reqs: int
    table_width: int  # block_tables columns
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    query_start_loc: np.ndarray | None  # int32 [R+1], host copy (None when rank 0 had none)
    seq_lens: np.ndarray | None  # int32 [R]

    @property
    def packed_size(self) -> int:
        t, r = self.num_tokens, self.num_reqs
        return 3 * t + 3 * r + 1 + r * self.table_width


@dataclass(slots=True)
class LogitsHeader:
    """Compute logits for ``num_rows`` hidden rows ``[num_rows, hidden_size]`` broadcast next."""

    num_rows: int


@dataclass(slots=True)
class Shutdown:
    """Leave the worker loop and exit."""


Command = StepHeader | LogitsHeader | Shutdown


def _host(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.numpy().copy()


def pack_step(inputs: ModelInputs) -> tuple[StepHeader, torch.Tensor]:
    """``(header, packed)``: ``packed`` int64 ``[header.packed_size]`` on the inputs' device."""
    b = inputs.batch
    header = StepHeader(
        num_tokens=b.num_tokens,
        num_reqs=b.num_reqs,
        table_width=b.block_tables.shape[1],
        max_query_len=b.max_query_len,
        max_seq_len=b.max_seq_len,
        num_decodes=b.num_decodes,
        query_start_loc=_host(b.query_start_loc_cpu),
        seq_lens=_host(b.seq_lens_cpu),
    )
    parts = (inputs.input_ids, inputs.positions, b.slot_mapping, b.query_start_loc, b.seq_lens, b.context_lens, b.block_tables)
    packed = torch.cat([p.reshape(-1).to(torch.int64) for p in parts])
    return header, packed


def unpack_step(header: StepHeader, packed: torch.Tensor) -> ModelInputs:
    """The :class:`ModelInputs` rank 0 packed, rebuilt on ``packed``'s device with the runner's dtypes."""
    t, r, w = header.num_tokens, header.num_reqs, header.table_width
    ids, pos, slots, qsl, seq_lens, ctx, tables = packed.split([t, t, t, r + 1, r, r, r * w])
    as_cpu = lambda a: None if a is None else torch.from_numpy(a)  # noqa: E731
    batch = AttentionBatch(
        query_start_loc=qsl.to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        context_lens=ctx.to(torch.int32),
        block_tables=tables.to(torch.int32).view(r, w),
        slot_mapping=slots.contiguous(),
        num_reqs=r,
        num_tokens=t,
        max_query_len=header.max_query_len,
        max_seq_len=header.max_seq_len,
        num_decodes=header.num_decodes,
        query_start_loc_cpu=as_cpu(header.query_start_loc),
        seq_lens_cpu=as_cpu(header.seq_lens),
    )
    return ModelInputs(input_ids=ids.contiguous(), positions=pos.contiguous(), batch=batch)
