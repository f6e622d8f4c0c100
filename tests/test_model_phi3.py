"""Phi-3 passes ``corerun conformance model:Phi3ForCausalLM`` against transformers in float64, from a
checkpoint with fused ``qkv_proj`` and ``gate_up_proj``; a fused tensor of the wrong size is named."""

from __future__ import annotations

import pytest
import torch

from corerun.conformance import run

CHECKS = {"weights", "prefill", "chunked_prefill", "prefix_decode", "greedy", "preemption"}


@pytest.mark.timeout(600)
def test_phi3_passes() -> None:
    results = run("model", "Phi3ForCausalLM", keyword="gqa-untied or (prefill and mha-tied)")
    assert len(results) == len(CHECKS) + 2
    assert [(r.id, r.reason) for r in results if r.outcome != "passed"] == []


def test_a_fused_tensor_of_the_wrong_size_is_a_shape_mismatch() -> None:
    from corerun.models.config import ModelConfig
    from corerun.models.layers import WeightShapeError
    from corerun.models.phi3 import Phi3ForCausalLM

    config = ModelConfig.from_dict(dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=32,
                                        intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
                                        rms_norm_eps=1e-6))
    model = Phi3ForCausalLM(config)
    param = model.model.layers[0].self_attn.qkv_proj.weight
    with pytest.raises(WeightShapeError) as info:
        param.weight_loader(param, torch.zeros(48, 32))  # q 32 + k 16 + v 16 = 64 rows
    assert info.value.expected == (64, 32)
    full = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    param.weight_loader(param, full)
    assert torch.equal(param, full)  # rows q | k | v land in the same order
