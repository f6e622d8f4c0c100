"""``gptq_cpu`` and ``awq_cpu``, and the W4A16 products of ``compressed_tensors_cpu``: 4-bit group-wise weights
multiplied in C++ straight from their codes.

GPTQ, AWQ and compressed-tensors ``pack-quantized`` store ``w = s (q - z)`` per group of input features; the
built-in methods decode every shard into floats on every call and multiply with ``F.linear``.  Here a layer's
shards are repacked once loaded (:func:`~corerun_quant_cpu.kernels.repack_w4`: the codes as GGUF Q4's nibbles,
the scales and ``-s z`` as float32 per 32, 64 or 128 features) and products of up to ``W4_MAX_TOKENS`` rows (32 in float32, 16 in bfloat16) go to
:func:`~corerun_quant_cpu.kernels.w4_gemv` (AVX-512 + VNNI: the activations quantized to int8 per token and
32-block, as ``gguf_cpu``'s products do; the conformance bound adds half an activation step); larger ones (prefill)
decode the repacked weights in C++ (:func:`~corerun_quant_cpu.kernels.w4_dequantize`, AVX-512: 8-9 ms for the default
model's decoder on one thread) and multiply in the activations' dtype with torch, where the built-in decodes through a dozen torch
operators (73 ms a scalar decode took, and the built-in's far longer).  Merged shards
(q/k/v, gate/up) in natural order are one repacked weight and one call; shards in activation order (GPTQ's
``desc_act``, compressed-tensors' ``actorder: group``) keep their own, the columns permuted so each group is
contiguous, and the activations are permuted to match on each call.  8-bit codes, widths not a multiple of 32
and groups narrower than 32 features take the built-in's path.  On a CPU without AVX-512 VNNI and VBMI every call
takes the decoded path (``w4_dequantize``'s scalar loop, which the compiler vectorizes for the baseline x86-64,
then torch's matmul): no int8 product there, and still one decode in C++ per call where the built-in's takes a
dozen torch operators.

A repacked layer keeps the checkpoint's parts as well (the built-in's path and ``dequantized`` read them):
about twice the 4-bit weights' memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from corerun.sdk.quantization import AWQMethod, GPTQMethod, QuantizedTensor

from corerun_quant_cpu import kernels
from corerun_quant_cpu.capabilities import AWQ_CPU, GPTQ_CPU

# above: the weights decoded once per call (w4_dequantize) and torch's matmul in x's dtype.  The default model's 120
# decoder products (benchmarks/w4_prefill_bench.py, one thread, an AMD EPYC Zen 4; ms, kernel / decode + matmul):
# float32 40.6 / 82.3 at 16 tokens, 97.4 / 108.7 at 32, 192.5 / 187.1 at 64; bfloat16 decode + matmul 53.1 at 16,
# 66.5 at 32 (the kernel's time is the same in either dtype: it multiplies int8 codes)
W4_MAX_TOKENS = {torch.float32: 32, torch.bfloat16: 16}
_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class W4Part:
    """One call of :func:`~corerun_quant_cpu.kernels.w4_gemv`: ``rows`` output features, ``perm`` the column order
    (``None``: natural)."""

    codes: torch.Tensor
    scales: torch.Tensor
    negzs: torch.Tensor
    gb: int
    perm: torch.Tensor | None

    @property
    def rows(self) -> int:
        return self.codes.shape[0]


def w4_part(w: QuantizedTensor) -> W4Part | None:
    """``w`` repacked for the kernel, or ``None`` where it cannot take it (see the module docstring)."""
    if w.scheme.bits != 4 or w.scheme.activations is not None:
        return None
    codes = w.codes()
    if codes is None or codes.q.device.type != "cpu":
        return None
    codes, perm = codes.in_group_order()
    packed = kernels.repack_w4(codes.q, codes.zeros, codes.scales, codes.groups)
    return None if packed is None else W4Part(*packed, perm=perm)


def w4_parts(shards: list[QuantizedTensor]) -> list[W4Part] | None:
    """A layer's shards as kernel calls, in output order: one call where every shard is in natural order with the
    same granule; ``None`` where any shard cannot be repacked."""
    parts = [w4_part(s) for s in shards]
    if any(p is None for p in parts):
        return None
    if len(parts) > 1 and all(p.perm is None and p.gb == parts[0].gb for p in parts):
        return [W4Part(*(torch.cat([getattr(p, k) for p in parts]) for k in ("codes", "scales", "negzs")), gb=parts[0].gb, perm=None)]
    return parts


class W4CpuMixin:
    """The W4A16 kernel for a :class:`~corerun.sdk.quantization.CompressedTensorsMethod`-like method (``PackedMethod``):
    put it before the built-in class in the bases."""

    def create_weights(self, layer: nn.Module, in_features: int, shard_sizes: Any) -> None:
        super().create_weights(layer, in_features, shard_sizes)  # type: ignore[misc]
        layer.w4 = None  # [W4Part], once every shard is loaded and each can be repacked
        layer.w4_kernel = False  # whether w4_gemv runs here (asked once, at load)

    def load_weight(self, layer: nn.Module, loaded: Any, shard_id: Hashable) -> None:
        super().load_weight(layer, loaded, shard_id)  # type: ignore[misc]
        shards = [layer.quantized.get(s) for s in layer.quantized_shards]
        if all(s is not None for s in shards):
            layer.w4 = w4_parts(shards)
            layer.w4_kernel = kernels.w4_available()

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in]`` -> ``[T, out]`` in ``x``'s dtype."""
        parts = layer.__dict__.get("w4")
        if parts is None or x.dim() != 2 or x.dtype not in _DTYPES or x.device.type != "cpu":
            return super().apply(layer, x)  # type: ignore[misc]
        if x.shape[0] > W4_MAX_TOKENS[x.dtype] or not layer.w4_kernel:  # decoded once per call in C++, torch's matmul
            outs = [F.linear(x if p.perm is None else x.index_select(1, p.perm), kernels.w4_dequantize(p.codes, p.scales, p.negzs, p.gb).to(x.dtype))
                    for p in parts]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        xf = x.float().contiguous()
        out = torch.empty(x.shape[0], sum(p.rows for p in parts), dtype=torch.float32)
        at = 0
        for p in parts:
            xp = xf if p.perm is None else xf.index_select(1, p.perm)
            kernels.w4_gemv(out[:, at : at + p.rows], p.codes, p.scales, p.negzs, xp, p.gb)
            at += p.rows
        return out if x.dtype == torch.float32 else out.to(x.dtype)


def _refuse_without_kernels(name: str) -> None:
    reasons = kernels.load()
    if reasons:
        raise RuntimeError(f"quantization method {name} cannot run here: " + "; ".join(reasons))


class GptqCpuMethod(W4CpuMixin, GPTQMethod):
    name = "gptq_cpu"
    capabilities = GPTQ_CPU

    def __init__(self) -> None:
        _refuse_without_kernels(self.name)


class AwqCpuMethod(W4CpuMixin, AWQMethod):
    name = "awq_cpu"
    capabilities = AWQ_CPU

    def __init__(self) -> None:
        _refuse_without_kernels(self.name)
