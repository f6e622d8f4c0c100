"""Broken quantized KV caches: the torch reference backend, declaring fp8_e4m3 / fp8_e5m2 / int8, with one fault each."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch

from corerun.protocols import kv_quant
from corerun.attention.torch_backend import TorchAttentionBackend
from corerun.protocols.attention import AttentionSpec


class ReadsWithoutScale(TorchAttentionBackend):
    """Stores ``x / scale`` correctly but reads the stored value back without multiplying by the scale."""

    name: ClassVar[str] = "reads-without-scale"

    def _gather(self, kv_cache: torch.Tensor, which: int, block_tables: torch.Tensor, length: int) -> torch.Tensor:
        bs = self.spec.block_size
        pos = torch.arange(length, device=kv_cache.device)
        blocks = block_tables[:, (pos // bs).clamp_(max=block_tables.shape[1] - 1)].long()
        rows = kv_cache[which][blocks, (pos % bs).expand_as(blocks)]
        return rows[..., : self.spec.head_size].to(self.compute_dtype)  # the stored numbers, never times a scale


class StoresUnquantized(TorchAttentionBackend):
    """Declares the quantized formats but keeps K/V in the model's dtype (more memory, no rounding)."""

    name: ClassVar[str] = "stores-unquantized"

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self.spec = replace(spec, kv_cache_dtype="auto")


class RoundsTowardZero(TorchAttentionBackend):
    """Truncates instead of rounding to nearest: int8 ``trunc(x / s)``; fp8 one step toward zero when the cast rounded up."""

    name: ClassVar[str] = "rounds-toward-zero"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        _, nb1, bs, h, d = kv_cache.shape
        flat = kv_cache.view(2, nb1 * bs, h, d).view(torch.uint8)
        slots = torch.where(slot_mapping < 0, (nb1 - 1) * bs, slot_mapping)
        for which, x in ((0, key), (1, value)):
            flat[which].index_copy_(0, slots, self._truncate(x, which).view(torch.uint8))

    def _truncate(self, x: torch.Tensor, which: int) -> torch.Tensor:
        s = self.spec
        if s.kv_cache_dtype == "int8":
            scale = kv_quant.int8_scale(x.float())
            return torch.cat([torch.trunc(x.float() / scale.float()).to(torch.int8), scale.view(torch.int8)], dim=-1)
        y = x.float() / s.kv_scales[which]
        q = kv_quant.quantize(x, s, which)
        bits = q.view(torch.uint8)
        up = (q.float().abs() > y.abs()) & (bits & 0x7F > 0)  # sign-magnitude: one code down is one step toward zero
        return torch.where(up, bits - 1, bits).view(q.dtype)
