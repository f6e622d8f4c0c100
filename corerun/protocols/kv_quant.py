"""Quantized KV-cache rows (``AttentionSpec.kv_cache_dtype``): what a backend stores and how it reads it back.

One stored row is one token's K (or V) of one KV head:

- ``fp8_e4m3`` / ``fp8_e5m2``: ``head_size`` fp8 values of ``x / scale``, with one static scale per tensor
  (``spec.kv_scales``: K's, V's; 1.0 unless configured), saturated at the format's largest finite value.
- ``int8``: ``head_size`` int8 values ``round(x / s)`` then the float32 ``s = amax(|x|) / 127`` of that row in
  the next four bytes (a scale per block slot and head, chosen when the row is written).

Both are computed in float32 (``x.float() / scale``), rounding to nearest even.
"""

from __future__ import annotations

import torch

from corerun.protocols.attention import INT8_SCALE_BYTES, KV_CACHE_DTYPES, AttentionSpec

INT8_MAX = 127.0


def is_quantized(spec: AttentionSpec) -> bool:
    return spec.kv_cache_dtype != "auto"


def storage_dtype(spec: AttentionSpec) -> torch.dtype:
    """The cache tensor's dtype: the model's, or the quantized element type."""
    return KV_CACHE_DTYPES[spec.kv_cache_dtype] if is_quantized(spec) else spec.dtype


def row_size(spec: AttentionSpec) -> int:
    """Elements of one stored row: ``head_size``, plus the scale's bytes for int8."""
    return spec.head_size + (INT8_SCALE_BYTES if spec.kv_cache_dtype == "int8" else 0)


def quantize(x: torch.Tensor, spec: AttentionSpec, which: int) -> torch.Tensor:
    """``x`` ``[..., head_size]`` -> stored rows ``[..., row_size]`` of :func:`storage_dtype` (``which``: 0 K, 1 V)."""
    xf = x.float()
    name = spec.kv_cache_dtype
    if name == "int8":
        scale = xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stores zeros
        q = torch.round(xf / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return torch.cat([q, scale.view(torch.int8)], dim=-1)
    fp8 = KV_CACHE_DTYPES[name]
    limit = torch.finfo(fp8).max
    return (xf / spec.kv_scales[which]).clamp_(-limit, limit).to(fp8)


def dequantize(rows: torch.Tensor, spec: AttentionSpec, which: int, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows ``[..., row_size]`` -> values ``[..., head_size]`` in ``dtype`` (``which``: 0 K, 1 V)."""
    d = spec.head_size
    work = torch.float64 if dtype == torch.float64 else torch.float32
    if spec.kv_cache_dtype == "int8":
        scale = rows[..., d:].contiguous().view(torch.float32)
        return (rows[..., :d].to(work) * scale.to(work)).to(dtype)
    return (rows.to(work) * spec.kv_scales[which]).to(dtype)


def values_view(cache: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """The stored values of a ``[..., row_size]`` cache (int8: without the scales)."""
    return cache[..., : spec.head_size]
