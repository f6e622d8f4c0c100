"""W8A8: int8 weights times int8 activations, accumulated exactly (as int32 would).

The activations are quantized per token (``dynamic``: ``s_x = max|x_t| / 127`` for each row) or with
the checkpoint's one ``input_scale`` (``static``), rounded to nearest and clamped to [-127, 127].
Then ``acc = x_q @ w_q.T`` and ``y = acc * s_x * s_w`` in float32.  Where ``acc`` is computed:

- CUDA: ``torch._int_mm`` (cuBLASLt int8 x int8 -> int32; it wants more than 16 rows: fewer are padded);
- CPU: the codes multiplied as float32 when every partial sum is an integer below 2**24 (input
  features <= 1032, as ``127 * 128 * 1032 < 2**24``: activation codes within 127, weight codes
  within 128), else as float64: exact either way, the same ``acc`` as int32.  ``torch._int_mm`` runs on CPU too but measured 20x slower than the float32
  product here (docs/quantization.md), so it is not used there.
"""

from __future__ import annotations

import torch

_INT_MM = hasattr(torch, "_int_mm")
EXACT_FLOAT32 = 2**24 // (127 * 128)  # input features whose products (activations to 127, weights to -128) sum exactly in float32


def quantize_activations(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[T, in]`` -> int8 codes ``[T, in]`` and float32 scales ``[T, 1]`` (or ``[1, 1]`` static)."""
    xf = x.float()
    if input_scale is None:
        scale = (xf.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    else:
        scale = input_scale.float().reshape(1, 1).to(x.device)
    return torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), scale


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``[T, in]`` float, ``weight`` int8 ``[out, in]``, ``weight_scale`` ``[out, 1]`` or ``[1, 1]``
    -> ``[T, out]`` in ``x.dtype``."""
    codes, x_scale = quantize_activations(x, input_scale)
    rows = codes.shape[0]
    if codes.is_cuda and _INT_MM:
        padded = torch.nn.functional.pad(codes, (0, 0, 0, max(0, 17 - rows)))
        acc = torch._int_mm(padded, weight.t())[:rows].float()
    else:
        exact = torch.float32 if codes.shape[1] <= EXACT_FLOAT32 else torch.float64
        acc = (codes.to(exact) @ weight.to(exact).t()).float()
    return (acc * x_scale * weight_scale.float().reshape(1, -1)).to(x.dtype)
