"""RoPE scaling (linear, llama3, dynamic NTK, YaRN, LongRoPE) against transformers' ROPE_INIT_FUNCTIONS and models."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from corerun.models import load_model
from corerun.models.config import ModelConfig
from corerun.models.rotary import attention_factor, inverse_frequencies
from corerun.testing.tiny_models import corerun_logits, hf_logits, make_tiny_model, max_rel_err, tiny_config

HEAD_DIM = 16  # tiny_config: hidden 64, 4 heads
SCALINGS: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-betas": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16,
                   "beta_slow": 2},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
                    "mscale_all_dim": 0.707 * 2},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "attention_factor": 0.8},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 64,
                 "short_factor": [1.0 + 0.25 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [2.0 + 0.5 * i for i in range(HEAD_DIM // 2)]},
}


def _configs(scaling: dict[str, Any]) -> tuple[Any, ModelConfig]:
    hf = tiny_config("llama", rope_scaling=dict(scaling), max_position_embeddings=256)
    return hf, ModelConfig.from_dict({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_inverse_frequencies_and_attention_factor_match_transformers(name: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config, config = _configs(SCALINGS[name])
    assert config.rope.rope_type == SCALINGS[name]["rope_type"]
    want_freq, want_factor = ROPE_INIT_FUNCTIONS[config.rope.rope_type](hf_config, "cpu")
    got = inverse_frequencies(HEAD_DIM, config.rope)
    assert torch.allclose(got.float(), want_freq.float(), rtol=1e-6, atol=0), (got, want_freq)
    assert attention_factor(config.rope) == pytest.approx(float(want_factor), rel=1e-12)


def test_scaled_ropes_differ_from_plain() -> None:
    """The comparison above can fail: every scaling changes the frequencies or the factor."""
    plain = inverse_frequencies(HEAD_DIM, _configs({"rope_type": "default"})[1].rope)
    for name, scaling in SCALINGS.items():
        if name == "dynamic":
            continue  # plain RoPE up to max_position_embeddings, by design
        rope = _configs(scaling)[1].rope
        assert not torch.equal(inverse_frequencies(HEAD_DIM, rope), plain) or attention_factor(rope) != 1.0, name


@pytest.mark.parametrize("name", ["yarn", "yarn-mscale", "longrope", "dynamic"])
def test_model_logits_match_transformers(tmp_path: Any, name: str) -> None:
    folder = make_tiny_model(tmp_path, "llama", rope_scaling=dict(SCALINGS[name]), max_position_embeddings=256)
    model, config = load_model(folder)
    assert config.rope.rope_type == SCALINGS[name]["rope_type"]
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    got = corerun_logits(model, ids, chunks=[17, 20, 1, 1, 1])
    assert max_rel_err(got, hf_logits(folder, ids)) < 2e-5


def test_longrope_caps_sequences_at_the_original_length() -> None:
    _, config = _configs(SCALINGS["longrope"])
    assert config.max_position_embeddings == 256 and config.max_model_len == 64


def test_longrope_factor_count_checked() -> None:
    from corerun.models.errors import ModelLoadError

    hf = tiny_config("llama", max_position_embeddings=256).to_dict()
    hf["rope_scaling"] = {**SCALINGS["longrope"], "short_factor": [1.0, 2.0]}
    hf.pop("rope_parameters", None)
    with pytest.raises(ModelLoadError, match="short_factor must list head_dim / 2 = 8 factors"):
        ModelConfig.from_dict(hf)
