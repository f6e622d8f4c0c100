"""Definitions the kernel tests of this folder share: which AMX units and W8A8 kernels this machine offers, the float64
definitions of the products with their rounding bounds, and a poisoned output that shows stray writes."""

from __future__ import annotations

import numpy as np
import torch

from corerun_quant_cpu import kernels

K_SIZES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per 256-value super-block


def amx_int8() -> bool:
    return not kernels.load() and kernels.int8_amx_available()


def int8_kernels() -> list[str]:
    """The W8A8 kernels this CPU runs (``amx``, ``vnni``), or none when the library does not build."""
    if kernels.load():
        return []
    return [k for k, ok in (("amx", kernels.int8_amx_available()), ("vnni", kernels.int8_vnni_available())) if ok]


def int8_linear(kernel: str, out: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> None:
    """``out`` = W8A8 of ``x`` by the int8 codes ``w`` (``[rows, cols]``) with row scales ``scale``, through ``kernel``."""
    if kernel == "amx":
        kernels.int8_amx_linear(out, kernels.repack_int8(w), scale, x)
    else:
        kernels.int8_vnni_linear(out, kernels.repack_int8(w), kernels.int8_corrections(w), scale, x)


def amx_bf16() -> bool:
    return not kernels.load() and kernels.bf16_best_isa() == "amx"


def w8a8_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8's definition (docs/quantization.md, "W8A8 on CPU") in float64: each token's scale
    ``max|x_t| / 127`` and codes ``round(x / s)`` (float32 division, half to even, clamped to 127), their
    exact product with the weight codes, times both scales."""
    xf = x.float()
    x_scale = xf.abs().amax(dim=1, keepdim=True).div(127.0).clamp_min(torch.finfo(torch.float32).tiny)
    codes = torch.div(xf, x_scale).round().clamp(-127, 127)
    return (codes.double() @ w.double().T) * scale.double().reshape(1, -1) * x_scale.double()


def w8a8_bound(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The output's one rounding (bfloat16: 2^-8 relative; float32: the int32 sum to float32, two products: 4 eps)."""
    rel = 2.0**-8 if dtype == torch.bfloat16 else 4 * torch.finfo(torch.float32).eps
    return rel * ref.abs() + 1e-30


def bf16_bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """One bfloat16 rounding of the result (half a unit in the 8th bit: 2^-9 relative, doubled) plus the
    float32 sum's rounding, ``8 sqrt(in) eps(float32) (|x| @ |W|.T)``."""
    eps32 = torch.finfo(torch.float32).eps
    return 2.0**-8 * ref.abs() + 8 * x.shape[1] ** 0.5 * eps32 * (x.double().abs() @ w.double().abs().T) + 1e-30


def f32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A float32 sum's rounding, ``4 sqrt(in) eps(float32) (|x| @ |W|.T)``: a sum of ``in`` products in float32 in
    any order is within ``in eps (|x| @ |W|)`` of the exact one, and within about ``sqrt(in)`` of that for random
    signs; the factor 4 covers the tail of the random walk."""
    eps32 = torch.finfo(torch.float32).eps
    return 4 * x.shape[1] ** 0.5 * eps32 * (x.double().abs() @ w.double().abs().T) + 1e-30


def poisoned_columns(tokens: int, rows: int, left: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-filled ``[tokens, rows + left + 3]`` tensor and its column slice ``left .. left + rows`` (the output a
    kernel writes, with a row stride wider than its rows)."""
    wide = torch.full((tokens, rows + left + 3), float("nan"), dtype=dtype)
    return wide, wide[:, left : left + rows]


def untouched_outside(wide: torch.Tensor, left: int, rows: int) -> bool:
    """Whether every column of ``wide`` outside ``left .. left + rows`` is still NaN."""
    return bool(torch.isnan(wide[:, :left].float()).all() and torch.isnan(wide[:, left + rows :].float()).all())


def k_blocks(type_name: str, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K-type super-blocks (every code, scale and minimum bit random) with float16 ``d`` and ``dmin`` of a
    weight's size, and their float64 decoding by the gguf package (which decodes these types, not quantizes)."""
    import gguf

    rng = np.random.default_rng(seed)
    size = K_SIZES[type_name]
    raw = rng.integers(0, 256, size=(rows, cols // 256 * size), dtype=np.uint8)
    sb = raw.reshape(-1, size)
    halves = (rng.uniform(0.2, 1.0, size=(sb.shape[0], 2)) * 1e-3).astype(np.float16).view(np.uint8)
    if type_name == "Q6_K":
        sb[:, 208:210] = halves[:, 0:2]
    else:
        sb[:, 0:4] = halves.reshape(-1, 4)
    decoded = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).astype(np.float64)
    return torch.from_numpy(raw), torch.from_numpy(decoded)


def matmul_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 products and sums of decoded values (each within half an ulp of float64's): the matmul bound."""
    return 8 * x.shape[1] ** 0.5 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.abs().T) + 1e-30


def int8_activation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x quantized per token and 32-block to dx round(x / dx), dx = max|x_b| / 127: within dx / 2 of x, so
    |sum_i w_i (x_i - x^_i)| <= sum_i |w_i| max|x_b(i)| / 254; the integer dot products are exact, the scaling
    and sums in float32 add the float bound of |x^| <= |x| + dx / 2."""
    T, cols = x.shape
    half_step = x.double().reshape(T, -1, 32).abs().amax(-1, keepdim=True).expand(T, cols // 32, 32).reshape(T, cols) / 254
    return half_step @ w.abs().T * (1 + 2.0**-20) + matmul_bound(x.abs() + half_step.float() * 1.01, w)


def int8_activation_sigma_bound(x: torch.Tensor, w: torch.Tensor, sigmas: float = 6.0) -> torch.Tensor:
    """The int8 activations' typical error, where :func:`int8_activation_bound` is the worst case: each ``x_i``'s
    rounding error lies evenly in ``[-dx / 2, dx / 2]``, independent of the others', so ``y_j``'s error has the
    standard deviation ``sqrt(sum_i w_ji^2 dx_b(i)^2 / 12)``; ``sigmas`` of them plus the float32 bound.  Activations
    rounded toward zero, a code offset off by one or a scale taken from the next group shift the error well past this
    while staying inside the worst case."""
    T, cols = x.shape
    dx = x.double().reshape(T, -1, 32).abs().amax(-1, keepdim=True).expand(T, cols // 32, 32).reshape(T, cols) / 127
    return sigmas * ((dx**2 / 12) @ (w**2).T).sqrt() + matmul_bound(x.abs() + dx.float() * 0.51, w)
