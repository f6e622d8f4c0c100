"""The commands rank 0 sends its workers, and a step's inputs packed into one tensor for them.

A step travels in two parts: a small :class:`StepHeader` on the command channel (host numbers,
shapes, and the host copies of ``query_start_loc`` / ``seq_lens``), then one tensor broadcast over
the process group (device to device under NCCL) holding every field of
:data:`~corerun.protocols.step_layout.STEP_FIELDS` at its own dtype, in the bytes of
:class:`~corerun.protocols.step_layout.StepLayout` (the runner's staging buffer has the same),
sent as int64 ``[nbytes / 8]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from corerun.protocols.graph import ModelInputs
from corerun.protocols.step_layout import StepLayout, model_inputs, step_tensors


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
    def layout(self) -> StepLayout:
        return StepLayout.of(self.num_tokens, self.num_reqs, self.table_width)

    @property
    def packed_size(self) -> int:
        """int64 elements of the packed tensor."""
        return self.layout.nbytes // 8


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
    lay = header.layout
    packed = torch.zeros(lay.nbytes // 8, dtype=torch.int64, device=inputs.input_ids.device)
    for dst, src in zip(lay.tensors(packed.view(torch.uint8)), step_tensors(inputs)):
        dst.copy_(src)
    return header, packed


def unpack_step(header: StepHeader, packed: torch.Tensor) -> ModelInputs:
    """The :class:`ModelInputs` rank 0 packed, as views of ``packed`` (on its device)."""
    as_cpu = lambda a: None if a is None else torch.from_numpy(a)  # noqa: E731
    return model_inputs(
        header.layout.tensors(packed.view(torch.uint8)),
        max_query_len=header.max_query_len,
        max_seq_len=header.max_seq_len,
        num_decodes=header.num_decodes,
        query_start_loc_cpu=as_cpu(header.query_start_loc),
        seq_lens_cpu=as_cpu(header.seq_lens),
    )
