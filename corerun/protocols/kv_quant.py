"""Quantized KV-cache rows (``AttentionSpec.kv_cache_dtype``): what a backend stores and how it reads it back.

One stored row is one token's K (or V) of one KV head:

- ``fp8_e4m3`` / ``fp8_e5m2``: ``head_size`` fp8 values of ``x / scale``, with one static scale per tensor
  (``spec.kv_scales``: K's, V's; 1.0 unless configured), saturated at the format's largest finite value.
- ``int8``: ``head_size`` int8 values ``round(x / s)`` then ``s`` in the next two bytes as a float16: ``amax(|x|) / 127``
  of that row rounded *up* to a float16 (so ``|x / s| <= 127`` and no value is clipped), at most ``65504`` (rows
  beyond ``127 * 65504`` saturate); an all-zero row stores ``s = 1``.  A scale per block slot and head, chosen
  when the row is written.  Two bytes rather than four make a row of head_size 64 66 bytes, 1.94x fewer than
  bfloat16's 128 (with a float32 scale: 68, 1.88x); rounding the scale up makes the step, and so the error bound
  ``s / 2``, at most ``2**-10`` larger than an exact scale's.

Both are computed in float32 (``x.float() / scale``), rounding to nearest even.
"""

from __future__ import annotations

import torch

from corerun.protocols.attention import INT8_SCALE_BYTES, KV_CACHE_DTYPES, AttentionSpec

INT8_MAX = 127.0
FLOAT16_MAX = 65504.0


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
        scale = int8_scale(xf)
        q = torch.round(xf / scale.float()).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return torch.cat([q, scale.view(torch.int8)], dim=-1)
    fp8 = KV_CACHE_DTYPES[name]
    limit = torch.finfo(fp8).max
    return (xf / spec.kv_scales[which]).clamp_(-limit, limit).to(fp8)


def int8_scale(xf: torch.Tensor) -> torch.Tensor:
    """float32 rows ``[..., head_size]`` -> their float16 scales ``[..., 1]``: ``amax / 127`` rounded up (1 for zeros)."""
    exact = (xf.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp_(max=FLOAT16_MAX)
    half = exact.to(torch.float16)
    half = torch.where(half.float() < exact, torch.nextafter(half, torch.full_like(half, torch.inf)), half)
    return torch.where(half > 0, half, torch.ones_like(half))


def dequantize(rows: torch.Tensor, spec: AttentionSpec, which: int, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows ``[..., row_size]`` -> values ``[..., head_size]`` in ``dtype`` (``which``: 0 K, 1 V)."""
    d = spec.head_size
    work = torch.float64 if dtype == torch.float64 else torch.float32
    if spec.kv_cache_dtype == "int8":
        scale = rows[..., d:].contiguous().view(torch.float16)
        return (rows[..., :d].to(work) * scale.to(work)).to(dtype)
    return (rows.to(work) * spec.kv_scales[which]).to(dtype)


def values_view(cache: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """The stored values of a ``[..., row_size]`` cache (int8: without the scales)."""
    return cache[..., : spec.head_size]
