"""FP8 weights on CUDA: ``torch._scaled_mm`` (e4m3 x e4m3 -> ``x.dtype``, scales applied per row).

Used for a float8_e4m3fn weight on a CUDA device of compute capability 8.9 or more (Ada, Hopper)
with both feature counts multiples of 16, as ``_scaled_mm`` asks; anything else decodes the weight
and multiplies in ``x.dtype`` (the CPU path).  The activations are quantized per token:
``s_x = max|x_t| / 448``, ``x_q = e4m3(x / s_x)``; ``y = (x_q @ w_q.T) * s_x * s_w``.  No GPU runs
this branch in corerun's tests; the ``_scaled_mm`` call runs on CPU too and is checked there.
"""

from __future__ import annotations

from typing import Any

import torch

E4M3_MAX = 448.0


def use_scaled_mm(w: Any, x: torch.Tensor) -> bool:
    weight = w.parts.get("weight")
    if weight is None or not x.is_cuda or weight.dtype != getattr(torch, "float8_e4m3fn", None):
        return False
    if not hasattr(torch, "_scaled_mm") or torch.cuda.get_device_capability(x.device) < (8, 9):
        return False
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, in]`` (CUDA), ``weight`` e4m3 ``[out, in]``, ``weight_scale`` ``[out, 1]`` or ``[1, 1]`` -> ``[T, out]``."""
    xf = x.float()
    x_scale = (xf.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp_min(1e-12)
    x_q = (xf / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    w_scale = weight_scale.float().reshape(1, -1).expand(1, weight.shape[0]).contiguous()
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    y = torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype)
    return y.to(x.dtype)
