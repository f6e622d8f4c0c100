"""A small correct paged attention backend and broken variants of it."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from corerun.plugin.capabilities import AttentionCapabilities
from corerun.errors import UnsupportedError
from corerun.protocols.attention import AttentionBatch, AttentionSpec
from corerun.sdk.attention import DenseKVCache


class NaiveAttentionBackend(DenseKVCache):
    """Correct: per-request gather of whole blocks through the block table, causal mask, float32 math.

    Declares a narrow set (no float64, head sizes 32/64/128, block sizes 8/16) so the suite's
    "undeclared combinations are refused" check has something to try.
    """

    name: ClassVar[str] = "naive"
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        dtypes=frozenset({"float16", "bfloat16", "float32"}),
        head_sizes=frozenset({32, 64, 128}),
        block_sizes=frozenset({8, 16}),
        devices=frozenset({"cpu", "cuda"}),
        gqa=True,
    )

    def __init__(self, spec: AttentionSpec) -> None:
        reasons = self.capabilities.check(spec)
        if reasons:
            raise UnsupportedError(f"attention backend '{self.name}'", reasons)
        self.spec = spec

    def plan(self, batch: AttentionBatch) -> AttentionBatch:
        return batch

    def _target_slots(self, slot_mapping: torch.Tensor, total: int) -> torch.Tensor:
        return slot_mapping

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        _, nb, bs, h, d = kv_cache.shape
        keep = slot_mapping >= 0
        slots = self._target_slots(slot_mapping[keep], nb * bs)
        kv_cache[0].view(nb * bs, h, d)[slots] = key[keep].to(kv_cache.dtype)
        kv_cache[1].view(nb * bs, h, d)[slots] = value[keep].to(kv_cache.dtype)

    def _blocks_to_read(self, seq_len: int) -> int:
        return -(-seq_len // self.spec.block_size)

    def _mask(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        return key_pos[None, :] <= query_pos[:, None]

    def _scale(self) -> float:
        return self.spec.softmax_scale

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        metadata: AttentionBatch, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        s = self.spec
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        k_cache, v_cache = self.kv_cache_view(kv_cache)
        out = torch.empty_like(query) if out is None else out
        starts = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens.tolist()
        group = s.num_heads // s.num_kv_heads
        scale = self._scale()
        for i in range(metadata.num_reqs):
            a, b = starts[i], starts[i + 1]
            ctx = seq_lens[i] - (b - a)
            table = metadata.block_tables[i, : self._blocks_to_read(seq_lens[i])].long()
            keys = k_cache[table].reshape(-1, s.num_kv_heads, s.head_size).float().repeat_interleave(group, dim=1)
            vals = v_cache[table].reshape(-1, s.num_kv_heads, s.head_size).float().repeat_interleave(group, dim=1)
            q = query[a:b].float()
            scores = torch.einsum("thd,nhd->htn", q, keys) * scale
            mask = self._mask(torch.arange(ctx, ctx + b - a, device=q.device), torch.arange(keys.shape[0], device=q.device))
            scores = scores.masked_fill(~mask[None], -math.inf)
            out[a:b] = torch.einsum("htn,nhd->thd", torch.softmax(scores, dim=-1), vals).to(out.dtype)
        return out


class DropsLastBlock(NaiveAttentionBackend):
    """Broken: never reads the last block of a sequence (keeps at least one)."""

    name = "drops-last-block"

    def _blocks_to_read(self, seq_len: int) -> int:
        return max(super()._blocks_to_read(seq_len) - 1, 1)


class IgnoresCausalMask(NaiveAttentionBackend):
    """Broken: attends to every slot of the blocks it reads (future prompt tokens on prefill,
    stale slots past the sequence end on decode)."""

    name = "ignores-causal-mask"

    def _mask(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        return torch.ones(len(query_pos), len(key_pos), dtype=torch.bool, device=query_pos.device)


class IgnoresPrefix(NaiveAttentionBackend):
    """Broken: attends only to the tokens of this step, never to what the cache held before it (a
    cached prefix, an earlier chunk, the tokens decoded so far); a prompt with nothing cached is right."""

    name = "ignores-prefix"

    def _mask(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        return super()._mask(query_pos, key_pos) & (key_pos[None, :] >= query_pos[0])


class ScaleOffBy0p2Percent(NaiveAttentionBackend):
    """Broken: softmax scale 0.2% too large (``1.002 / sqrt(head_size)``)."""

    name = "scale-off-by-0.2%"

    def _scale(self) -> float:
        return self.spec.softmax_scale * 1.002


class WritesSlotPlusOne(NaiveAttentionBackend):
    """Broken: writes each token's K/V one slot after the one named (wrapping at the end)."""

    name = "writes-slot-plus-one"

    def _target_slots(self, slot_mapping: torch.Tensor, total: int) -> torch.Tensor:
        return (slot_mapping + 1) % total


def factory(cls: type[NaiveAttentionBackend]) -> Any:
    """``factory(spec, **options)`` for ``corerun.conformance.run``."""
    return lambda spec, **options: cls(spec, **options)
