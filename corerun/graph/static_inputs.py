"""The static input tensors every captured decode graph reads, owned by the CUDA-graph runner.

A CUDA graph replays fixed device addresses, so each step's inputs are copied into the same
tensors the graphs were captured with.  One set, sized for ``max_batch_size`` requests, serves
every bucket: bucket ``b`` reads the first ``b`` rows through views made once.
"""

from __future__ import annotations

import torch

from corerun.protocols.attention import AttentionBatch
from corerun.protocols.graph import GraphLimits, ModelInputs
from corerun.protocols.step_layout import STEP_FIELDS, StepTensors, model_inputs, step_tensors


def max_blocks_per_seq(limits: GraphLimits) -> int:
    """``ceil(max_model_len / block_size)``: the width of the static block table."""
    return -(-limits.max_model_len // limits.block_size)


class StaticDecodeInputs:
    """Device tensors for up to ``limits.max_batch_size`` pure-decode requests (one token each).

    One tensor per field of :data:`~corerun.protocols.step_layout.STEP_FIELDS` (in :attr:`fields`,
    and as attributes of the same names), shaped for ``max_batch`` tokens and requests and a block
    table ``ceil(max_model_len / block_size)`` wide; ``query_start_loc`` is always ``0, 1, 2, ...``
    (one query token per request).

    A row that holds no real request is padding: each field holds its :attr:`StepField.pad` (token 0
    at position 0, slot ``-1`` so nothing is written to the KV cache, ``seq_lens`` 1, ``context_lens``
    0, block-table row of zeros).  Everything outside the rows and columns the last :meth:`load`
    wrote is padding.
    """

    def __init__(self, limits: GraphLimits) -> None:
        dev, n = torch.device(limits.device), limits.max_batch_size
        self.max_batch_size = n
        self.max_model_len = limits.max_model_len
        self.max_blocks_per_seq = max_blocks_per_seq(limits)
        self.fields = StepTensors._make(
            torch.arange(n + 1, dtype=f.dtype, device=dev) if f.pad is None
            else torch.full(f.shape(n, n, self.max_blocks_per_seq), f.pad, dtype=f.dtype, device=dev)
            for f in STEP_FIELDS
        )
        self._real_rows = 0  # rows [0, _real_rows) may hold a request's values
        self._real_cols = 0  # block-table columns [0, _real_cols) of those rows may be non-zero

    def __getattr__(self, name: str) -> torch.Tensor:
        if name in StepTensors._fields:  # static.input_ids, static.block_tables, ...
            return getattr(self.fields, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.fields)

    def inputs(self, size: int) -> ModelInputs:
        """A pure-decode step of ``size`` requests viewing the first ``size`` rows (no copies).

        ``max_seq_len`` is ``max_model_len`` (an upper bound valid for every step the graph replays) and
        the host copies ``query_start_loc_cpu`` / ``seq_lens_cpu`` are ``None``: inside a graph they would go stale.
        """
        if not 1 <= size <= self.max_batch_size:
            raise ValueError(f"bucket size must be in [1, {self.max_batch_size}], got {size}")
        rows = StepTensors._make(
            t[: f.shape(size, size, 0)[0]] for f, t in zip(STEP_FIELDS, self.fields)
        )
        return model_inputs(rows, max_query_len=1, max_seq_len=self.max_model_len, num_decodes=size)

    def batch(self, size: int) -> AttentionBatch:
        """The :class:`AttentionBatch` of :meth:`inputs`."""
        return self.inputs(size).batch

    def load(self, inputs: ModelInputs) -> None:
        """Copy a pure-decode step's ``n`` requests into rows ``[0, n)``; every other row becomes padding.

        Only rows and block-table columns the previous step wrote are reset, so a steady batch size
        costs just the copies.  The caller checked that ``n <= max_batch_size`` and that the block
        table is at most ``max_blocks_per_seq`` wide.
        """
        n, width = inputs.batch.num_reqs, inputs.batch.block_tables.shape[1]
        for f, static, src in zip(STEP_FIELDS, self.fields, step_tensors(inputs)):
            if f.pad is None:  # the same in every pure decode
                continue
            if src is None:  # (a hand-made step without this optional field: padding values)
                static[:n].fill_(f.pad)
                continue
            if static.dim() == 2:
                static[:n, :width].copy_(src, non_blocking=True)
                if width < self._real_cols:
                    static[:n, width : self._real_cols].fill_(f.pad)
            else:
                static[:n].copy_(src, non_blocking=True)
        if n < self._real_rows:
            self.pad(n, self._real_rows)
        self._real_rows, self._real_cols = n, (width if n else 0)

    def pad(self, start: int, stop: int) -> None:
        """Make rows ``[start, stop)`` padding rows."""
        for f, static in zip(STEP_FIELDS, self.fields):
            if f.pad is not None:
                static[start:stop].fill_(f.pad)
