"""Which layers adapters may target: a mixture-of-experts block's parts are told by name alone
(:func:`corerun.lora.layers.in_moe_block`), for the model's modules and an adapter's checkpoint alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from corerun.lora.layers import in_moe_block, lora_targets

MOE_CONFIGS = {
    "MixtralForCausalLM": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "Qwen2MoeForCausalLM": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                            "shared_expert_intermediate_size": 48},
    "LlamaForCausalLM": {},
}


def _corerun_model(tmp: Path, arch: str) -> torch.nn.Module:
    import transformers

    from corerun.testing.tiny_models import load_corerun_model

    cls = getattr(transformers, arch)
    keys = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=256, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    cls(cls.config_class(**keys, **MOE_CONFIGS[arch])).save_pretrained(tmp / arch)
    return load_corerun_model(tmp / arch)[0]


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_targets_are_the_linear_layers_outside_every_block_with_experts(tmp_path, arch):
    """Against the model's structure: the linear layers that no module holding ``experts`` contains."""
    model = _corerun_model(tmp_path, arch)
    blocks = [f"{n}." for n, m in model.named_modules() if hasattr(m, "experts")]
    linear = {n for n, m in model.named_modules() if isinstance(getattr(m, "in_features", None), int) and hasattr(m, "product")}
    want = {n for n in linear if not n.startswith(tuple(blocks))}
    assert bool(blocks) == (arch != "LlamaForCausalLM")
    assert set(lora_targets(model)) == want and any(n.endswith("self_attn.qkv_proj") for n in want)


@pytest.mark.parametrize(("name", "moe"), [
    ("model.layers.0.block_sparse_moe.experts.0.w1", True),  # Mixtral's per-expert checkpoints
    ("model.layers.0.block_sparse_moe.gate", True),
    ("model.layers.1.mlp.gate", True),  # Qwen-MoE's router (and newer Mixtral checkpoints')
    ("model.layers.0.mlp.experts.1.down_proj", True),
    ("model.layers.0.mlp.shared_expert.gate_proj", True),
    ("model.layers.0.mlp.shared_expert_gate", True),
    ("model.layers.0.mlp.gate_proj", False),
    ("model.layers.0.mlp.gate_up_proj", False),
    ("model.layers.0.self_attn.q_proj", False),
    ("model.layers.0.mlp.down_proj", False),
])
def test_moe_parts_by_name(name, moe):
    assert in_moe_block(name) is moe
