"""The ``triton`` backend's per-step plan: references to the batch's tensors plus host-side launch choices."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from corerun.protocols.attention import AttentionBatch

from corerun_attention_triton.split_rule import choose_num_splits


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class TritonAttentionMetadata:
    """What ``forward`` launches with; built by ``TritonAttentionBackend.plan`` once per step.

    The tensors are the batch's own (never copies), so a CUDA graph captured with this plan reads
    whatever the runner writes into them before a replay.  The integers depend only on shapes.
    """

    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks_per_seq]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    num_reqs: int
    num_tokens: int
    num_decodes: int  # the first num_decodes requests have one query token each
    num_splits: int  # > 1: those decodes take the split-KV path; 1: everything takes the unified kernel
    block_m: int  # unified kernel: rows per tile (block_q tokens x the query heads of one KV head)
    block_q: int  # unified kernel: query tokens per tile
    tile_n: int  # keys per inner step (both kernels)
    autotune: bool  # the unified launch may autotune warps / stages (compiled prefill only)

    @property
    def split_decodes(self) -> bool:
        return self.num_splits > 1 and self.num_decodes > 0


def make_plan(
    batch: AttentionBatch,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    num_sms: int | None,
    forced_splits: int | None,
    interpret: bool,
) -> TritonAttentionMetadata:
    """Tile sizes and the split-KV choice for ``batch``, from host integers alone.

    ``num_sms`` is the device's SM count (``None`` in the interpreter); ``forced_splits`` overrides
    the split rule (``1`` never splits, ``N`` always splits decodes ``N`` ways).
    """
    group = num_heads // num_kv_heads
    head_pad = max(16, _next_pow2(head_size))
    max_rows = 64 if head_pad <= 128 else 32  # keeps the float32 accumulator in registers
    # Enough rows for the longest query (times the heads of a group), at least the 16 tl.dot needs.
    block_m = max(16, _next_pow2(group), min(max_rows, _next_pow2(max(1, batch.max_query_len) * group)))
    tile_n = 64 if head_pad <= 128 else 32
    if forced_splits is not None:
        num_splits = forced_splits
    else:
        num_splits = choose_num_splits(batch.num_decodes, num_kv_heads, batch.max_seq_len, num_sms)
    return TritonAttentionMetadata(
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        slot_mapping=batch.slot_mapping,
        num_reqs=batch.num_reqs,
        num_tokens=batch.num_tokens,
        num_decodes=batch.num_decodes,
        num_splits=num_splits,
        block_m=block_m,
        block_q=max(1, block_m // group),
        tile_n=tile_n,
        autotune=not interpret and batch.max_query_len > 1,
    )
