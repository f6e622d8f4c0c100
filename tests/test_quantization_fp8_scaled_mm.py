"""The FP8 CUDA branch's product (``fp8_linear``, ``torch._scaled_mm``) run on CPU where torch has it, against
float64: the activations rounded to e4m3 per token (half a unit in the last place, 2**-4 of each value,
or 2**-10 of the row's scale where subnormal) and the bfloat16 output's own rounding."""

from __future__ import annotations

import pytest
import torch

from corerun.quantization.fp8_cuda import fp8_linear, use_scaled_mm
from corerun.quantization.quantized_tensor import QuantizedTensor
from corerun.quantization.schemes import fp8


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_linear_is_within_the_e4m3_activation_bound(per_channel: bool) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 64, generator=g, dtype=torch.float64)
    top = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax().reshape(1, 1)
    scale = (top / 448).float()
    q = (w / scale.double()).to(torch.float8_e4m3fn)
    x = torch.randn(5, 64, generator=g).bfloat16()
    try:
        y = fp8_linear(x, q, scale)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {exc}")
    wd = q.double() * scale.double()
    want = x.double() @ wd.T
    x_step = x.double().abs().amax(1, keepdim=True) / 448  # the per-token scale of the activations
    act = (x.double().abs() * 2**-4 + x_step * 2**-10) @ wd.abs().T
    bound = act * 1.01 + 2**-8 * want.abs() + 1e-6
    assert ((y.double() - want).abs() <= bound).all()
    assert y.dtype == torch.bfloat16 and y.shape == (5, 32)


def test_scaled_mm_is_used_only_for_e4m3_weights_on_cuda() -> None:
    t = QuantizedTensor("w", fp8(True), {"weight": torch.zeros(32, 64).to(torch.float8_e4m3fn)}, 32, 64)
    assert not use_scaled_mm(t, torch.zeros(1, 64))  # CPU activations: the decoded weight and F.linear
