"""The ``torch`` LoRA kernel against the merged-weights product in float64."""

from __future__ import annotations

import pytest
import torch

from corerun.lora.reference import TorchLoRAKernel
from corerun.protocols.lora import LoRAKernel, LoRAKernelCapabilities, LoRANeed


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h_in, slices, num_slots, max_rank, ranks = 12, (8, 4, 4), 3, 6, (6, 2, 4)
    w = [torch.randn(out, h_in, generator=g, dtype=torch.float64) for out in slices]
    a = [torch.zeros(num_slots, max_rank, h_in, dtype=torch.float64) for _ in slices]
    b = [torch.zeros(num_slots, out, max_rank, dtype=torch.float64) for out in slices]
    for s, r in enumerate(ranks):  # adapters of smaller rank zero-padded
        for i, out in enumerate(slices):
            a[i][s, :r] = torch.randn(r, h_in, generator=g, dtype=torch.float64)
            b[i][s, :, :r] = torch.randn(out, r, generator=g, dtype=torch.float64)
    scalings = torch.tensor([16 / 6, 0.5, 8 / 4 ** 0.5], dtype=torch.float32)
    return w, a, b, scalings, slices


def test_torch_kernel_equals_merged_weights_per_token():
    w, a, b, scalings, slices = _case()
    token_slots = torch.tensor([2, -1, 0, 1, 1, -1, 0, 2], dtype=torch.int32)
    x = torch.randn(len(token_slots), 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.cat([x @ w_i.T for w_i in w], dim=1)
    base = y.clone()
    TorchLoRAKernel().add_lora(y, x, a, b, scalings, token_slots, slices)
    for t, s in enumerate(token_slots.tolist()):
        if s < 0:
            assert torch.equal(y[t], base[t])  # untouched, bit for bit
            continue
        merged = torch.cat([w_i + float(scalings[s]) * (b_i[s] @ a_i[s]) for w_i, a_i, b_i in zip(w, a, b)])
        torch.testing.assert_close(y[t], x[t] @ merged.T, rtol=1e-10, atol=1e-10)


def test_torch_kernel_is_a_lora_kernel_and_declares_graph_safety():
    kernel = TorchLoRAKernel()
    assert isinstance(kernel, LoRAKernel)
    assert kernel.capabilities.graph_safe
    assert kernel.capabilities.fits(LoRANeed(device="cpu", dtype="float32", graphs=True)) == []
    narrow = LoRAKernelCapabilities(devices=frozenset({"cuda"}), dtypes=frozenset({"float16"}), max_rank=8, max_slots=2)
    reasons = narrow.fits(LoRANeed(device="cpu", dtype="float32", max_rank=16, max_slots=4, graphs=True))
    assert len(reasons) == 5 and "max_lora_rank 16" in reasons[2] and "max_loras 4" in reasons[3]
    with pytest.raises(TypeError, match="takes no options"):
        TorchLoRAKernel(block=4)
