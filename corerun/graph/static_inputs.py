"""The static input tensors every captured decode graph reads, owned by the CUDA-graph runner.

A CUDA graph replays fixed device addresses, so each step's inputs are copied into the same
tensors the graphs were captured with.  One set, sized for ``max_batch_size`` requests, serves
every bucket: bucket ``b`` reads the first ``b`` rows through views made once.
"""

from __future__ import annotations

import torch

from corerun.protocols.attention import AttentionBatch
from corerun.protocols.graph import GraphLimits, ModelInputs


def max_blocks_per_seq(limits: GraphLimits) -> int:
    """``ceil(max_model_len / block_size)``: the width of the static block table."""
    return -(-limits.max_model_len // limits.block_size)


class StaticDecodeInputs:
    """Device tensors for up to ``limits.max_batch_size`` pure-decode requests (one token each).

    - ``input_ids``, ``positions``, ``slot_mapping``: int64 ``[max_batch]``
    - ``seq_lens``, ``context_lens``: int32 ``[max_batch]``
    - ``query_start_loc``: int32 ``[max_batch + 1]``, always ``0, 1, 2, ...`` (one query token per request)
    - ``block_tables``: int32 ``[max_batch, ceil(max_model_len / block_size)]``

    A row that holds no real request is padding: token 0 at position 0, slot ``-1`` (nothing is
    written to the KV cache), ``seq_lens`` 1, ``context_lens`` 0, block-table row of zeros.
    Everything outside the rows and columns the last :meth:`load` wrote is padding.
    """

    def __init__(self, limits: GraphLimits) -> None:
        dev, n = torch.device(limits.device), limits.max_batch_size
        self.max_batch_size = n
        self.max_model_len = limits.max_model_len
        self.max_blocks_per_seq = max_blocks_per_seq(limits)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self._real_rows = 0  # rows [0, _real_rows) may hold a request's values
        self._real_cols = 0  # block-table columns [0, _real_cols) of those rows may be non-zero

    def nbytes(self) -> int:
        tensors = (self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.context_lens,
                   self.query_start_loc, self.block_tables)
        return sum(t.numel() * t.element_size() for t in tensors)

    def batch(self, size: int) -> AttentionBatch:
        """A pure-decode :class:`AttentionBatch` of ``size`` requests viewing the first ``size`` rows (no copies).

        ``max_seq_len`` is ``max_model_len`` (an upper bound valid for every step the graph replays) and
        the host copies ``query_start_loc_cpu`` / ``seq_lens_cpu`` are ``None``: inside a graph they would go stale.
        """
        if not 1 <= size <= self.max_batch_size:
            raise ValueError(f"bucket size must be in [1, {self.max_batch_size}], got {size}")
        return AttentionBatch(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            num_reqs=size,
            num_tokens=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            num_decodes=size,
            query_start_loc_cpu=None,
            seq_lens_cpu=None,
        )

    def load(self, inputs: ModelInputs) -> None:
        """Copy a pure-decode step's ``n`` requests into rows ``[0, n)``; every other row becomes padding.

        Only rows and block-table columns the previous step wrote are reset, so a steady batch size
        costs just the copies.  The caller checked that ``n <= max_batch_size`` and that the block
        table is at most ``max_blocks_per_seq`` wide.
        """
        b = inputs.batch
        n, width = b.num_reqs, b.block_tables.shape[1]
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(b.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(b.seq_lens, non_blocking=True)
        self.context_lens[:n].copy_(b.context_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(b.block_tables, non_blocking=True)
        if width < self._real_cols:
            self.block_tables[:n, width : self._real_cols].zero_()
        if n < self._real_rows:
            self.pad(n, self._real_rows)
        self._real_rows, self._real_cols = n, (width if n else 0)

    def pad(self, start: int, stop: int) -> None:
        """Make rows ``[start, stop)`` padding rows."""
        self.input_ids[start:stop].zero_()
        self.positions[start:stop].zero_()
        self.slot_mapping[start:stop].fill_(-1)
        self.seq_lens[start:stop].fill_(1)
        self.context_lens[start:stop].zero_()
        self.block_tables[start:stop].zero_()
