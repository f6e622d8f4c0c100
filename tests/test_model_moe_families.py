"""Mixtral, Qwen2-MoE and Qwen3-MoE pass ``corerun conformance model:ARCH`` against transformers in
float64 (checkpoints as ``save_pretrained`` writes them: one tensor per expert); families that get the
routing wrong fail it."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from corerun.conformance import run
from corerun.models.mixtral import MixtralForCausalLM
from corerun.models.moe import MoeConfig
from corerun.models.qwen_moe import Qwen2MoeForCausalLM

CHECKS = {"weights", "prefill", "chunked_prefill", "prefix_decode", "greedy", "preemption"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"])
def test_expert_family_passes(arch: str) -> None:
    results = run("model", arch, keyword="gqa-untied or (prefill and mha-tied)")
    assert len(results) == len(CHECKS) + 2
    assert [(r.id, r.reason) for r in results if r.outcome != "passed"] == []


class MixtralNotRenormalised(MixtralForCausalLM):
    """Keeps the top-k softmax weights as they are (Qwen without norm_topk_prob) where Mixtral renormalises."""

    hf_architecture: ClassVar[str] = "MixtralForCausalLM"

    def __init__(self, config: Any, tp: Any = None) -> None:
        super().__init__(config, tp)
        for layer in self.model.layers:
            layer.block_sparse_moe.renormalize = False


class Qwen2MoeUngatedSharedExpert(Qwen2MoeForCausalLM):
    """Adds the shared expert without its sigmoid gate."""

    hf_architecture: ClassVar[str] = "Qwen2MoeForCausalLM"

    def __init__(self, config: Any, tp: Any = None) -> None:
        super().__init__(config, tp)
        for layer in self.model.layers:
            if layer.mlp.__class__.__name__ == "SparseMoeBlock":
                layer.mlp.shared_expert_gate.forward = lambda x: x.new_full((x.shape[0], 1), 1e9)  # sigmoid -> 1


@pytest.mark.timeout(600)
@pytest.mark.parametrize("broken", [MixtralNotRenormalised, Qwen2MoeUngatedSharedExpert], ids=lambda c: c.__name__)
def test_wrong_routing_is_rejected(broken: type) -> None:
    results = run("model", factory=broken, keyword="gqa-untied and (prefill or weights)")
    got = {r.check: r for r in results}
    assert got["weights"].outcome == "passed"  # every tensor loads: only the logits show the fault
    assert got["prefill"].outcome == "failed" and "differ from transformers" in got["prefill"].reason


def test_expert_settings_are_checked_before_allocation() -> None:
    from corerun.models.config import ModelConfig
    from corerun.models.errors import ModelLoadError

    base = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                max_position_embeddings=128, rms_norm_eps=1e-6)
    with pytest.raises(ModelLoadError, match=r"num_experts_per_tok 3 is more than the 2 experts \(num_local_experts\)"):
        MixtralForCausalLM(ModelConfig.from_dict({**base, "num_local_experts": 2, "num_experts_per_tok": 3}))
    with pytest.raises(ModelLoadError, match=r"num_local_experts \(the number of experts\) is missing"):
        MixtralForCausalLM(ModelConfig.from_dict({**base, "num_experts_per_tok": 2}))
    qwen = ModelConfig.from_dict({**base, "model_type": "qwen2_moe", "num_experts": 8, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 16, "norm_topk_prob": True})
    assert MoeConfig.read(qwen, ("num_experts",), "moe_intermediate_size", "norm_topk_prob") == MoeConfig(8, 2, 16, True, 0)
