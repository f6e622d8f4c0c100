"""corerun's models against Hugging Face transformers, on tiny random checkpoints (CPU, float32).

Logits are compared normwise (``max |corerun - hf| / max |hf|``); attention runs through the torch
reference backend over a NaN-poisoned paged KV cache with scrambled block tables.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open

from corerun.models import (
    ModelConfig,
    UnsupportedModelError,
    get_model_class,
    load_model,
    supported_architectures,
)
from corerun.models.config import RopeConfig
from corerun.models.rotary import inverse_frequencies
from tests.helpers.tiny_models import corerun_logits, hf_logits, hf_model, make_tiny_model, max_rel_err

TOL = 1e-5
PROMPT_LENGTHS = (1, 5, 13, 37)


def _prompt(n: int, seed: int = 0, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed + n)).tolist()


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param)
    model, config = load_model(folder, dtype="float32", device="cpu")
    return request.param, folder, model, config, hf_model(folder)


def test_prefill_logits_match_hf(tiny):
    _, _, model, _, hf = tiny
    for n in PROMPT_LENGTHS:
        ids = _prompt(n)
        err = max_rel_err(corerun_logits(model, ids), hf_logits(hf, ids))
        assert err < TOL, f"prompt of {n} tokens: relative error {err:.2e}"


def test_chunked_prefill_and_decodes_match_hf(tiny):
    """Positions and the KV cache carry across steps: later chunks and single-token decodes see earlier ones."""
    _, _, model, _, hf = tiny
    ids = _prompt(21, seed=3)
    err = max_rel_err(corerun_logits(model, ids, chunks=[7, 1, 1, 9, 1, 2]), hf_logits(hf, ids))
    assert err < TOL


def test_architecture_specifics(tiny):
    arch, _, model, config, _ = tiny
    attn = model.model.layers[0].self_attn
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert (attn.qkv_proj.bias is not None) == (arch == "qwen2")
    assert attn.o_proj.bias is None
    assert (attn.q_norm is not None) == (arch == "qwen3")
    assert config.head_dim == (32 if arch == "qwen3" else 16)  # Qwen3: explicit, != hidden / heads
    assert model.num_layers == config.num_layers == 2
    if arch == "mistral":
        assert config.sliding_window == 4096 and config.max_model_len == 256
    if arch == "qwen2":
        assert config.sliding_window is None  # use_sliding_window: false


def test_attention_spec_and_layer_calls(tiny):
    _, _, model, config, _ = tiny
    spec = model.attention_spec(torch.float32, 16, "cpu")
    assert (spec.num_heads, spec.num_kv_heads, spec.head_size) == (4, 2, config.head_dim)
    assert (spec.dtype, spec.block_size, spec.device) == (torch.float32, 16, torch.device("cpu"))
    assert spec.softmax_scale == pytest.approx(config.head_dim**-0.5)

    calls = []

    class RecordingContext:
        def attend(self, layer_idx, q, k, v):
            calls.append((layer_idx, q.shape, k.shape, v.shape, q.dtype))
            return torch.randn_like(q)

    t = 6
    hidden = model(torch.arange(t), torch.arange(t), RecordingContext())
    d = config.head_dim
    assert calls == [(i, (t, 4, d), (t, 2, d), (t, 2, d), torch.float32) for i in range(2)]
    assert hidden.shape == (t, 64) and torch.isfinite(hidden).all()
    logits = model.compute_logits(hidden[-2:])
    assert logits.shape == (2, 256) and logits.dtype == torch.float32


def test_tied_embeddings(tmp_path):
    folder = make_tiny_model(tmp_path, "llama", tie_word_embeddings=True)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    model, config = load_model(folder, dtype="float32")
    assert config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = _prompt(11)
    assert max_rel_err(corerun_logits(model, ids), hf_logits(folder, ids)) < TOL


@pytest.mark.parametrize(
    "rope_scaling",
    [
        pytest.param({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}, id="llama3"),
        pytest.param({"rope_type": "linear", "factor": 4.0}, id="linear"),
    ],
)
def test_rope_scaling_matches_hf(tmp_path, rope_scaling):
    folder = make_tiny_model(tmp_path, "llama", rope_scaling=rope_scaling, rope_theta=500.0)
    model, config = load_model(folder, dtype="float32")
    assert config.rope.rope_type == rope_scaling["rope_type"]
    ids = _prompt(70, seed=5)
    ref = hf_logits(folder, ids)
    assert max_rel_err(corerun_logits(model, ids), ref) < TOL
    plain, _ = load_model(make_tiny_model(tmp_path, "llama", rope_theta=500.0), dtype="float32")
    assert max_rel_err(corerun_logits(plain, ids), ref) > 1e-2  # the scaling changes the answer


def _meta_llama3_scaling(freqs: list[float], factor, low, high, old_len) -> list[float]:
    """Meta's reference ``apply_scaling`` (llama-models), per frequency in float64."""
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            out.append(freq)
        elif wavelen > old_len / low:
            out.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def test_llama3_inverse_frequencies_match_meta_reference():
    head_dim, theta = 128, 500000.0
    rope = RopeConfig(theta=theta, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)
    plain = [theta ** (-i / head_dim) for i in range(0, head_dim, 2)]
    expected = _meta_llama3_scaling(plain, 8.0, 1.0, 4.0, 8192)
    got = inverse_frequencies(head_dim, rope).tolist()
    assert got == pytest.approx(expected, rel=1e-12)
    kinds = {("kept" if e == p else "divided" if e == pytest.approx(p / 8) else "smoothed") for e, p in zip(expected, plain)}
    assert kinds == {"kept", "divided", "smoothed"}  # every band is exercised


# ------------------------------------------------------------------ config.json spellings

_BASE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
}


def test_dtype_spellings():
    new = ModelConfig.from_dict({**_BASE, "dtype": "bfloat16"})
    old = ModelConfig.from_dict({**_BASE, "torch_dtype": "bfloat16"})
    assert new.torch_dtype == old.torch_dtype == torch.bfloat16
    assert new == old
    assert ModelConfig.from_dict({**_BASE, "torch_dtype": "torch.float16"}).torch_dtype == torch.float16
    assert ModelConfig.from_dict(_BASE).torch_dtype is None


@pytest.mark.parametrize("scaling_key", ["rope_type", "type"])
def test_rope_spellings(scaling_key):
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    new = ModelConfig.from_dict({**_BASE, "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", **llama3}})
    old = ModelConfig.from_dict({**_BASE, "rope_theta": 5e5, "rope_scaling": {scaling_key: "llama3", **llama3}})
    assert new.rope == old.rope == RopeConfig(5e5, "llama3", 8.0, 1.0, 4.0, 8192)
    assert new.rope_theta == 5e5
    plain_new = ModelConfig.from_dict({**_BASE, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
    plain_old = ModelConfig.from_dict({**_BASE, "rope_theta": 1e6})
    assert plain_new.rope == plain_old.rope == RopeConfig(theta=1e6)
    assert ModelConfig.from_dict(_BASE).rope == RopeConfig(theta=10000.0)


def test_legacy_config_file_loads_like_hf(tmp_path):
    """A transformers-4 config.json (torch_dtype, rope_theta + rope_scaling.type) gives HF's logits."""
    import json

    folder = make_tiny_model(tmp_path, "llama", rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=700.0)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg.update(torch_dtype=cfg.pop("dtype"), rope_theta=700.0, rope_scaling={"type": "linear", "factor": 2.0})
    (folder / "config.json").write_text(json.dumps(cfg))
    model, config = load_model(folder)  # dtype auto: the checkpoint's float32
    assert config.rope == RopeConfig(theta=700.0, rope_type="linear", factor=2.0)
    assert next(model.parameters()).dtype == torch.float32
    ids = _prompt(40, seed=9)
    assert max_rel_err(corerun_logits(model, ids), hf_logits(folder, ids)) < TOL


def test_derived_and_explicit_sizes():
    derived = ModelConfig.from_dict({k: v for k, v in _BASE.items() if k != "num_key_value_heads"})
    assert (derived.head_dim, derived.num_kv_heads) == (16, 4)
    explicit = ModelConfig.from_dict({**_BASE, "head_dim": 128, "eos_token_id": [7, 9], "bos_token_id": 1})
    assert explicit.head_dim == 128 and explicit.eos_token_ids == (7, 9) and explicit.bos_token_id == 1


def test_generation_config_eos_ids_are_added(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({**_BASE, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert ModelConfig.from_model_dir(tmp_path).eos_token_ids == (2, 5)


@pytest.mark.parametrize("rope", [{"rope_type": "su", "factor": 4.0}, {"type": "proportional", "factor": 2.0}])
def test_unsupported_rope_type(rope):
    with pytest.raises(UnsupportedModelError) as exc:
        ModelConfig.from_dict({**_BASE, "rope_scaling": rope})
    msg = str(exc.value)
    assert repr(rope.get("rope_type", rope.get("type"))) in msg
    assert "default, linear, llama3, dynamic, yarn, longrope" in msg


def test_bad_config_values():
    with pytest.raises(ValueError, match="'hidden_size' is missing"):
        ModelConfig.from_dict({k: v for k, v in _BASE.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="multiple of num_key_value_heads 3"):
        ModelConfig.from_dict({**_BASE, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="dtype 'int8'"):
        ModelConfig.from_dict({**_BASE, "dtype": "int8"})


def test_unsupported_architecture_lists_supported():
    config = ModelConfig.from_dict({**_BASE, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(UnsupportedModelError) as exc:
        get_model_class(config)
    msg = str(exc.value)
    assert "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg
    assert supported_architectures() == sorted(["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                                "Qwen3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                                                "Qwen3MoeForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
                                                "Gemma3ForCausalLM"])


def test_unsupported_activation():
    config = ModelConfig.from_dict({**_BASE, "hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'.*'silu'"):
        get_model_class(config)(config)


def test_bfloat16_and_dtype_callable(tiny):
    arch, folder, _, _, hf = tiny
    seen = []
    model, _ = load_model(folder, dtype=lambda ckpt: seen.append(ckpt) or torch.bfloat16)
    assert seen == [torch.float32]  # the checkpoint's dtype, from config.json
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    ids = _prompt(13)
    got = corerun_logits(model, ids)
    assert got.dtype == torch.float32
    assert max_rel_err(got, hf_logits(hf, ids)) < 5e-2  # bfloat16 weights and activations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_every_head_as_the_float64_formula(dtype):
    """``Rope.apply`` (``x * [cos|cos] + [x2|x1] * [-sin|sin]``, q and k heads together) against the
    rotation written out in float64 from the angles ``position * theta ** (-2i / D)``."""
    from corerun.models.config import RopeConfig
    from corerun.models.rotary import RotaryEmbedding

    d, theta = 16, 10000.0
    rotary = RotaryEmbedding(d, 64, RopeConfig(theta=theta))
    g = torch.Generator().manual_seed(5)
    positions = torch.tensor([0, 3, 17, 63])
    x = torch.randn(4, 5, d, generator=g).to(dtype)  # 5 heads: q and k side by side
    got = rotary.angles(positions).apply(x)
    angle = positions.double()[:, None, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    x1, x2 = x.double().chunk(2, dim=-1)
    want = torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], dim=-1)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert float((got.double() - want).norm() / want.norm()) < tol
