"""``TritonAttentionBackend``: corerun's ``AttentionBackend`` protocol over the Triton kernels.

Cache layout: one tensor ``[2, num_blocks, block_size, num_kv_heads, head_size]`` per layer (K then V),
so the canonical views are plain indexing.  Each step: ``plan`` once, then per layer ``forward`` =
KV write by slot mapping + attention (split-KV decodes when the plan says so, the unified kernel for
everything else).  On a machine without CUDA the kernels run in Triton's interpreter on CPU.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch

from corerun import AttentionCapabilities, UnsupportedError
from corerun.protocols.attention import AttentionBatch, AttentionSpec
from corerun.sdk.attention import DenseKVCache

from corerun_attention_triton import _mode
from corerun_attention_triton.capabilities import CAPABILITIES
from corerun_attention_triton.kernels import INTERPRET  # settles interpreter-or-compiled mode first
from corerun_attention_triton.kernels.kv_write import write_kv_cache
from corerun_attention_triton.kernels.split_kv_decode import split_kv_decode
from corerun_attention_triton.kernels.split_kv_reduce import split_kv_reduce
from corerun_attention_triton.kernels.unified_attention import unified_attention
from corerun_attention_triton.metadata import TritonAttentionMetadata, make_plan
from corerun_attention_triton.split_rule import MAX_SPLITS


def mode_reasons(device: torch.device | str) -> list[str]:
    """Why this process's kernel mode cannot serve ``device`` (empty when it can)."""
    dev = torch.device(device).type
    setting = os.environ.get(_mode.ENV)
    if dev == "cpu" and not INTERPRET:
        how = f"{_mode.ENV}={setting!r} is set" if setting is not None else "a CUDA device is present"
        return [
            f"device cpu needs the Triton interpreter, but this process compiles the kernels for CUDA ({how}); "
            f"set {_mode.ENV}=1 before corerun_attention_triton is imported, or use device cuda"
        ]
    if dev == "cuda" and INTERPRET:
        return [
            f"device cuda needs compiled Triton kernels, but {_mode.ENV}={setting!r} runs them in the "
            f"interpreter; unset {_mode.ENV} (or use device cpu)"
        ]
    return []


def _check_num_splits(num_splits: Any) -> int | None:
    if num_splits == "auto":
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(
            f"triton attention option num_splits must be 'auto' or an integer in 1..{MAX_SPLITS}, got {num_splits!r}"
        )
    return num_splits


class TritonAttentionBackend(DenseKVCache):
    """Triton paged attention. ``TritonAttentionBackend(spec, num_splits="auto")``.

    ``num_splits``: ``"auto"`` (the split-KV rule of ``split_rule``), ``1`` (never split), or ``N``
    (always split decodes into ``N`` slices).  Raises :class:`corerun.UnsupportedError` listing every
    reason when ``spec`` is outside :data:`capabilities` or this process's kernel mode.
    """

    name: ClassVar[str] = "triton"
    capabilities: ClassVar[AttentionCapabilities] = CAPABILITIES

    def __init__(self, spec: AttentionSpec, num_splits: int | str = "auto") -> None:
        reasons = CAPABILITIES.check(spec) + mode_reasons(spec.device)
        if reasons:
            raise UnsupportedError("attention backend 'triton'", reasons)
        self.spec = spec
        self.forced_splits = _check_num_splits(num_splits)
        self.mode = _mode.INTERPRETED if INTERPRET else _mode.COMPILED
        device = torch.device(spec.device)
        self.num_sms: int | None = None
        if device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count

    # ------------------------------------------------------------------- step
    def plan(self, batch: AttentionBatch) -> TritonAttentionMetadata:
        s = self.spec
        return make_plan(
            batch, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_size=s.head_size,
            num_sms=self.num_sms, forced_splits=self.forced_splits, interpret=INTERPRET,
        )

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self._check_tokens("key", key, self.spec.num_kv_heads)
        self._check_tokens("value", value, self.spec.num_kv_heads)
        k_cache, v_cache = self.kv_cache_view(kv_cache)
        write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._check_tokens("query", query, self.spec.num_heads)
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        if query.stride(-1) != 1:
            query = query.contiguous()
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        elif out.shape != query.shape or out.stride(-1) != 1:
            raise ValueError(
                f"out must have the query's shape {list(query.shape)} with a contiguous last dim, "
                f"got shape {list(out.shape)} strides {list(out.stride())}"
            )
        if metadata.num_tokens == 0:
            return out
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        m = metadata
        req_start = 0
        if m.split_decodes:
            part_out, part_lse = split_kv_decode(
                query, k_cache, v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
                num_decodes=m.num_decodes, num_splits=m.num_splits, scale=self.spec.softmax_scale, tile_n=m.tile_n,
            )
            split_kv_reduce(out, part_out, part_lse, m.query_start_loc)
            req_start = m.num_decodes  # decodes come first, one token each
        unified_attention(
            out, query, k_cache, v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
            req_start=req_start, num_reqs=m.num_reqs, num_q_tokens=m.num_tokens - req_start,
            scale=self.spec.softmax_scale, block_m=m.block_m, block_q=m.block_q, tile_n=m.tile_n,
            autotune=m.autotune,
        )
        return out

    def _check_tokens(self, what: str, t: torch.Tensor, heads: int) -> None:
        s = self.spec
        if t.dim() != 3 or t.shape[1] != heads or t.shape[2] != s.head_size or t.dtype != s.dtype:
            raise ValueError(
                f"{what} must be [num_tokens, {heads}, {s.head_size}] {str(s.dtype).removeprefix('torch.')}, "
                f"got {list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
            )
