"""W8A8's product on CPU: the int8 codes accumulated exactly (as int32 would), then scaled in float32, on both
sides of the width where float32 accumulation stops being exact (1032 input features)."""

from __future__ import annotations

import pytest
import torch

from corerun.quantization.int8_matmul import EXACT_FLOAT32, int8_linear


@pytest.mark.parametrize("cols", [EXACT_FLOAT32, 1537])
def test_int8_linear_is_exact_integer_accumulation(cols: int) -> None:
    g = torch.Generator().manual_seed(1)
    # large codes of one sign: the wide sums pass 2**24, where float32 accumulation would round
    weight = torch.randint(100, 128, (6, cols), generator=g).to(torch.int8)
    weight[0] = -128
    x = torch.randint(100, 128, (3, cols), generator=g).float()
    x[:, 0] = 127.0  # each row's scale is exactly 1: its codes are x itself
    w_scale = torch.rand(6, 1, generator=g) + 0.5
    acc = x.long() @ weight.long().T  # int64: exact
    want = acc.float() * w_scale.reshape(1, -1)  # int32 accumulation, then float32 scaling
    assert torch.equal(int8_linear(x, weight, w_scale, None), want)
