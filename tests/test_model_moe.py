"""The mixture-of-experts layer (corerun/models/moe.py): routing against hand-computed answers, both
experts kernels against a per-expert dense float64 reference written here, per-expert checkpoint
tensors loaded into the stacked weights, and tensor parallel 2 summing to tensor parallel 1."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from corerun.models.layers import WeightShapeError
from corerun.models.moe import FusedExperts, SparseMoeBlock, experts_reference, grouped_experts, route

H, I, E = 16, 12, 6


def test_route_takes_top_k_of_the_softmax_and_renormalises_when_asked() -> None:
    logits = torch.tensor([[math.log(1), math.log(2), math.log(3), math.log(4)]], dtype=torch.float64)
    weights, ids = route(logits, 2, renormalize=False)  # probabilities 0.1, 0.2, 0.3, 0.4
    assert ids.tolist() == [[3, 2]]
    assert torch.allclose(weights, torch.tensor([[0.4, 0.3]], dtype=torch.float64))
    weights, ids = route(logits, 2, renormalize=True)
    assert torch.allclose(weights, torch.tensor([[4 / 7, 3 / 7]], dtype=torch.float64))
    weights, _ = route(logits.to(torch.bfloat16), 2, renormalize=True)
    assert weights.dtype == torch.float32  # a bfloat16 router's softmax runs in float32


def _experts(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    gate = [torch.randn(I, H, generator=g, dtype=torch.float64) / H**0.5 for _ in range(E)]
    up = [torch.randn(I, H, generator=g, dtype=torch.float64) / H**0.5 for _ in range(E)]
    down = [torch.randn(H, I, generator=g, dtype=torch.float64) / I**0.5 for _ in range(E)]
    return gate, up, down


def _dense_reference(x, gate, up, down, weights, ids) -> torch.Tensor:
    """Every expert on every token, dense, each scaled by its routing weight (0 where not chosen)."""
    out = torch.zeros_like(x)
    for e in range(E):
        scale = (weights * (ids == e)).sum(dim=1, keepdim=True)
        out += scale * ((F.silu(x @ gate[e].T) * (x @ up[e].T)) @ down[e].T)
    return out


@pytest.mark.parametrize("kernel", [experts_reference, grouped_experts], ids=lambda k: k.__name__)
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_experts_kernels_equal_a_dense_per_expert_reference(kernel, top_k: int) -> None:
    gate, up, down = _experts()
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    logits = torch.randn(9, E, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    logits[:, 5] = -1e9  # expert 5 gets no token
    weights, ids = route(logits, top_k, renormalize=top_k > 1)
    stacked_gate_up = torch.stack([torch.cat([gate[e], up[e]]) for e in range(E)])
    stacked_down = torch.stack(down)
    got = kernel(x, stacked_gate_up, stacked_down, weights, ids)
    want = _dense_reference(x, gate, up, down, weights, ids)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (got - want).abs().max()


def _load(experts: FusedExperts, gate, up, down) -> None:
    for e in range(E):
        for param, which, tensor in ((experts.gate_up_proj.weight, "gate", gate[e]), (experts.gate_up_proj.weight, "up", up[e]),
                                     (experts.down_proj.weight, "down", down[e])):
            param.weight_loader(param, tensor, (e, which))


def test_per_expert_tensors_load_into_the_stacked_weights_and_shapes_are_checked() -> None:
    gate, up, down = _experts()
    experts = FusedExperts(E, H, I).double()
    _load(experts, gate, up, down)
    assert torch.equal(experts.gate_up_proj.weight[3], torch.cat([gate[3], up[3]]))
    assert torch.equal(experts.down_proj.weight[4], down[4])
    param = experts.down_proj.weight
    with pytest.raises(WeightShapeError) as info:
        param.weight_loader(param, down[0].T, (0, "down"))
    assert (info.value.expected, info.value.got) == ((H, I), (I, H))
    with pytest.raises(ValueError, match=r"expert shard must be \(expert in 0..5"):
        param.weight_loader(param, down[0], (E, "down"))


def test_tensor_parallel_2_splits_each_expert_and_sums_to_1() -> None:
    gate, up, down = _experts()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, H, generator=g, dtype=torch.float64)
    router = torch.randn(E, H, generator=g, dtype=torch.float64)
    shared = [torch.randn(8, H, generator=g, dtype=torch.float64), torch.randn(8, H, generator=g, dtype=torch.float64),
              torch.randn(H, 8, generator=g, dtype=torch.float64), torch.randn(1, H, generator=g, dtype=torch.float64)]

    def block(tp) -> SparseMoeBlock:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            b = SparseMoeBlock(H, E, 2, I, renormalize=False, shared_intermediate_size=8, tp=tp)
        finally:
            torch.set_default_dtype(previous)
        b.gate.weight.weight_loader(b.gate.weight, router)
        _load(b.experts, gate, up, down)
        gu = b.shared_expert.gate_up_proj
        gu.weight.weight_loader(gu.weight, shared[0], "gate")
        gu.weight.weight_loader(gu.weight, shared[1], "up")
        b.shared_expert.down_proj.weight.weight_loader(b.shared_expert.down_proj.weight, shared[2])
        b.shared_expert_gate.weight.weight_loader(b.shared_expert_gate.weight, shared[3])
        return b

    whole = block(None)(x)
    ranks = [SimpleNamespace(rank=r, world_size=2, all_reduce=lambda t: t) for r in range(2)]  # partial sums kept
    parts = [block(tp) for tp in ranks]
    assert parts[0].experts.gate_up_proj.weight.shape == (E, I, H)  # each rank: half of every expert's features
    assert torch.allclose(parts[0](x) + parts[1](x), whole, rtol=1e-12, atol=1e-12)
    # and the block equals the dense reference plus the sigmoid-gated shared expert
    weights, ids = route(x @ router.T, 2, renormalize=False)
    shared_out = (F.silu(x @ shared[0].T) * (x @ shared[1].T)) @ shared[2].T
    want = _dense_reference(x, gate, up, down, weights, ids) + torch.sigmoid(x @ shared[3].T) * shared_out
    assert torch.allclose(whole, want, rtol=1e-12, atol=1e-12)
