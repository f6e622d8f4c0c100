"""A step's layout: the one description of the arrays a step hands the model, and the one builder of its inputs.

:data:`STEP_FIELDS` names every per-token and per-request array of a step, with its dtype, its extent
(how many elements, as a function of the step's tokens, requests and block-table width) and the value
a padding row holds.  Everything that lays out a step takes it from here:

- the runner's host staging buffer (:class:`corerun.runner.step_inputs.StepInputs`): one byte buffer
  in :class:`StepLayout`, each field on a 16-byte boundary, copied to the device once per step;
- the CUDA-graph runner's static inputs (:mod:`corerun.graph.static_inputs`): one tensor per field,
  sized for the largest bucket, padding rows as :attr:`StepField.pad` says;
- the memory profile's dummy steps and the test and conformance batches (:func:`requests_step`).

And every :class:`AttentionBatch` is made by :func:`model_inputs` from the fields plus the step's host
values.  Adding a field: one :class:`StepField` here, the attribute on :class:`AttentionBatch` (or
:class:`ModelInputs`), how :class:`~corerun.runner.step_inputs.StepInputs` computes it, and how
:func:`requests_step` computes it.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

from corerun.protocols.attention import AttentionBatch
from corerun.protocols.graph import ModelInputs

ALIGN = 16  # bytes; where each field starts in a staging buffer (Triton specialises pointer arguments on 16-byte divisibility)

# extents: what a field has one element (or one row) of
TOKENS = "tokens"
REQUESTS = "requests"
QUERY_STARTS = "requests + 1"
BLOCK_TABLE = "requests x table width"


@dataclass(frozen=True)
class StepField:
    """One array of a step.

    ``pad`` is what a padding row holds (a CUDA-graph bucket's rows past the real requests: decodes of
    one token at position 0 that write nothing); ``None`` for ``query_start_loc``, which in a pure
    decode is ``0, 1, 2, ...`` whatever the requests, padding included.
    """

    name: str
    dtype: torch.dtype
    extent: str
    pad: int | None
    on_batch: bool  # an AttentionBatch attribute; else a ModelInputs one

    def shape(self, num_tokens: int, num_reqs: int, table_width: int) -> tuple[int, ...]:
        if self.extent == TOKENS:
            return (num_tokens,)
        if self.extent == REQUESTS:
            return (num_reqs,)
        if self.extent == QUERY_STARTS:
            return (num_reqs + 1,)
        return (num_reqs, table_width)


STEP_FIELDS: tuple[StepField, ...] = (
    StepField("input_ids", torch.int64, TOKENS, pad=0, on_batch=False),
    StepField("positions", torch.int64, TOKENS, pad=0, on_batch=False),
    StepField("slot_mapping", torch.int64, TOKENS, pad=-1, on_batch=True),
    StepField("query_start_loc", torch.int32, QUERY_STARTS, pad=None, on_batch=True),
    StepField("seq_lens", torch.int32, REQUESTS, pad=1, on_batch=True),
    StepField("context_lens", torch.int32, REQUESTS, pad=0, on_batch=True),
    StepField("block_tables", torch.int32, BLOCK_TABLE, pad=0, on_batch=True),
    StepField("lora_slots", torch.int32, TOKENS, pad=-1, on_batch=False),
)
"""Every array of a step, in the order they lie in a staging buffer; see :class:`AttentionBatch` for what each means."""


class StepTensors(NamedTuple):
    """A step's arrays (tensors or numpy arrays), one per :data:`STEP_FIELDS` entry, in its order."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    lora_slots: torch.Tensor


if StepTensors._fields != tuple(f.name for f in STEP_FIELDS):  # pragma: no cover  (caught by any import)
    raise AssertionError(f"StepTensors fields {StepTensors._fields} differ from STEP_FIELDS")

_NUMPY = {torch.int64: np.dtype(np.int64), torch.int32: np.dtype(np.int32)}
_DTYPES = tuple(dict.fromkeys(f.dtype for f in STEP_FIELDS))
_MULTI_DIM = tuple(i for i, f in enumerate(STEP_FIELDS) if f.extent == BLOCK_TABLE)


def _up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class StepLayout(NamedTuple):
    """Where each field of a step of ``num_tokens`` tokens and ``num_reqs`` requests with block tables
    ``table_width`` wide lies in one byte buffer: field ``i`` (of :data:`STEP_FIELDS`) is ``sizes[i]``
    bytes at byte ``offsets[i]``, a multiple of :data:`ALIGN`; ``nbytes`` (also a multiple) is the whole.

    Build it with :meth:`of` (cached: a steady batch asks for the same layout every step).
    """

    num_tokens: int
    num_reqs: int
    table_width: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    spans: tuple[tuple[int, int], ...]  # each field's (start, stop) in elements of its own dtype
    nbytes: int

    @staticmethod
    def of(num_tokens: int, num_reqs: int, table_width: int) -> StepLayout:
        return _layout(num_tokens, num_reqs, table_width)

    def tensors(self, staged: torch.Tensor) -> StepTensors:
        """The fields as views of ``staged`` (uint8 ``[nbytes]``, on any device)."""
        as_dtype = {d: staged.view(d) for d in _DTYPES}  # (few torch calls: each costs a microsecond or more)
        views = [as_dtype[f.dtype][start:stop] for f, (start, stop) in zip(STEP_FIELDS, self.spans)]
        for i in _MULTI_DIM:
            views[i] = views[i].view(self.shapes[i])
        return StepTensors._make(views)

    def arrays(self, staged: np.ndarray) -> StepTensors:
        """The fields as numpy views of ``staged`` (uint8 ``[nbytes]`` or longer): what a fill writes."""
        nd = np.ndarray
        return StepTensors._make([nd(s, _NUMPY[f.dtype], staged, o) for f, o, s in zip(STEP_FIELDS, self.offsets, self.shapes)])

    def host_tensors(self, staged: np.ndarray) -> StepTensors:
        """The fields as CPU tensors sharing ``staged``'s memory: :meth:`tensors` on CPU, in about a third of the time."""
        return StepTensors._make(map(torch.from_numpy, self.arrays(staged)))


@functools.lru_cache(maxsize=512)
def _layout(num_tokens: int, num_reqs: int, table_width: int) -> StepLayout:
    if min(num_tokens, num_reqs, table_width) < 0:
        raise ValueError(
            f"a step layout needs counts >= 0, got num_tokens={num_tokens}, num_reqs={num_reqs}, table_width={table_width}"
        )
    offsets, sizes, shapes, spans, at = [], [], [], [], 0
    for f in STEP_FIELDS:
        shape = f.shape(num_tokens, num_reqs, table_width)
        size = int(np.prod(shape)) * f.dtype.itemsize
        offsets.append(at)
        sizes.append(size)
        shapes.append(shape)
        end = _up(at + size, ALIGN)
        spans.append((at // f.dtype.itemsize, (at + size) // f.dtype.itemsize))
        at = end
    return StepLayout(num_tokens, num_reqs, table_width, tuple(offsets), tuple(sizes), tuple(shapes), tuple(spans), at)


def step_tensors(inputs: ModelInputs) -> StepTensors:
    """The fields of ``inputs``, in :data:`STEP_FIELDS` order."""
    b = inputs.batch
    return StepTensors._make(getattr(b if f.on_batch else inputs, f.name) for f in STEP_FIELDS)


def model_inputs(
    fields: StepTensors,
    *,
    max_query_len: int,
    max_seq_len: int,
    num_decodes: int,
    query_start_loc_cpu: torch.Tensor | None = None,
    seq_lens_cpu: torch.Tensor | None = None,
) -> ModelInputs:
    """The :class:`ModelInputs` (and its :class:`AttentionBatch`) of a step's fields and host values.

    ``num_tokens`` and ``num_reqs`` are the lengths of ``input_ids`` and ``seq_lens``.
    """
    batch = AttentionBatch(  # the fields STEP_FIELDS marks on_batch
        query_start_loc=fields.query_start_loc,
        seq_lens=fields.seq_lens,
        context_lens=fields.context_lens,
        block_tables=fields.block_tables,
        slot_mapping=fields.slot_mapping,
        num_reqs=fields.seq_lens.shape[0],
        num_tokens=fields.input_ids.shape[0],
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        num_decodes=num_decodes,
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens_cpu=seq_lens_cpu,
    )
    return ModelInputs(input_ids=fields.input_ids, positions=fields.positions, batch=batch, lora_slots=fields.lora_slots)


def requests_step(
    context_lens: Sequence[int],
    query_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    *,
    input_ids: Sequence[int] | None = None,
    num_padding: int = 0,
    max_seq_len: int | None = None,
) -> ModelInputs:
    """A step of requests with ``query_lens[i]`` new tokens after ``context_lens[i]`` cached ones, built plainly.

    For the memory profile's dummy steps, tests and the conformance suites (the runner's own steps come
    from :class:`~corerun.runner.step_inputs.StepInputs`).  Request ``i``'s block table is
    ``block_tables[i]`` (zero-padded to the longest); its tokens sit at positions ``context_lens[i]``
    onwards, with slots from its table; token ids are ``input_ids`` (default 0).  ``num_padding``
    padding rows follow, each holding the :attr:`StepField.pad` values.  ``max_seq_len`` defaults to
    the longest sequence.  Requests with one new token (decodes) must come first, as the runner orders them.
    """
    n = len(query_lens)
    if len(context_lens) != n or len(block_tables) != n or n == 0:
        raise ValueError(
            f"need at least one request and one context length and block table per request, got {n} query lengths, "
            f"{len(context_lens)} context lengths and {len(block_tables)} block tables"
        )
    if min(query_lens) < 1:
        raise ValueError(f"every request needs at least one new token, got query_lens={list(query_lens)}")
    num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), n)
    if any(q == 1 for q in query_lens[num_decodes:]):
        raise ValueError(f"decodes (query length 1) must come first, got query_lens={list(query_lens)}")
    if num_padding and num_decodes < n:
        raise ValueError(
            f"padding rows are decodes, so they can only follow decodes; got {num_padding} after query_lens={list(query_lens)}"
        )
    for i, (c, q, table) in enumerate(zip(context_lens, query_lens, block_tables)):
        if len(table) * block_size < c + q:
            raise ValueError(
                f"request {i}'s block table has {len(table)} blocks, but its {c} + {q} tokens need "
                f"{-(-(c + q) // block_size)} blocks of {block_size}"
            )
    positions = [p for c, q in zip(context_lens, query_lens) for p in range(c, c + q)]
    slots = [
        table[p // block_size] * block_size + p % block_size
        for c, q, table in zip(context_lens, query_lens, block_tables)
        for p in range(c, c + q)
    ]
    if input_ids is None:
        input_ids = [0] * len(positions)
    elif len(input_ids) != len(positions):
        raise ValueError(f"input_ids has {len(input_ids)} tokens, but the query lengths add up to {len(positions)}")
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    width = max(len(t) for t in block_tables)
    pads = {f.name: f.pad for f in STEP_FIELDS}
    values = {
        "input_ids": list(input_ids) + [pads["input_ids"]] * num_padding,
        "positions": positions + [pads["positions"]] * num_padding,
        "slot_mapping": slots + [pads["slot_mapping"]] * num_padding,
        "query_start_loc": [0, *itertools.accumulate(list(query_lens) + [1] * num_padding)],
        "seq_lens": seq_lens + [pads["seq_lens"]] * num_padding,
        "context_lens": list(context_lens) + [pads["context_lens"]] * num_padding,
        "block_tables": [list(t) + [pads["block_tables"]] * (width - len(t)) for t in block_tables]
        + [[pads["block_tables"]] * width] * num_padding,
        "lora_slots": [pads["lora_slots"]] * (len(positions) + num_padding),
    }
    host = StepTensors._make(torch.tensor(values[f.name], dtype=f.dtype).reshape(f.shape(
        len(positions) + num_padding, n + num_padding, width)) for f in STEP_FIELDS)
    return model_inputs(
        StepTensors._make(t.to(device) for t in host),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens) if max_seq_len is None else max_seq_len,
        num_decodes=num_decodes + num_padding,
        query_start_loc_cpu=host.query_start_loc,
        seq_lens_cpu=host.seq_lens,
    )
