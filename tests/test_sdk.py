"""corerun.sdk, the plugin author's toolkit: the dense KV write, the base attention backend's checks,
seeded generators, capability checks, and Gemma's building blocks in corerun.sdk.models against
transformers and closed forms.  (Its reference_attention passes the whole attention suite
in test_plugin_platform.py, as the certified ``narrow`` backend and the scaffolded ``foo``.)"""

from __future__ import annotations

import pytest
import torch

from corerun import AttentionCapabilities, SamplerCapabilities, UnsupportedError
from corerun.protocols.attention import AttentionSpec
from corerun.sampling_params import SamplingParams
from corerun.sdk import require_params, require_spec
from corerun.sdk.attention import DenseAttentionBackend, write_kv
from corerun.sdk.sampling import row_seed, seeded_generator, seeded_rows


def _cache(num_blocks: int = 5, block_size: int = 4, heads: int = 2, head_size: int = 8) -> torch.Tensor:
    return torch.full((2, num_blocks, block_size, heads, head_size), float("nan"))


@pytest.mark.parametrize("slots", [[7, -1, 0, 19, -1, 3], [-1, -1, 12, 5], [4, 9, 2]], ids=["mixed", "padding-first", "all-real"])
def test_write_kv_writes_exactly_the_named_slots(slots: list[int]) -> None:
    g = torch.Generator().manual_seed(len(slots))
    key, value = torch.randn(len(slots), 2, 8, generator=g), torch.randn(len(slots), 2, 8, generator=g)
    cache = _cache()
    write_kv(key, value, cache, torch.tensor(slots))
    flat = cache.view(2, 20, 2, 8)
    written = {s for s in slots if s >= 0}
    for row, slot in enumerate(slots):
        if slot >= 0:
            assert torch.equal(flat[0, slot], key[row]) and torch.equal(flat[1, slot], value[row])
    untouched = [s for s in range(20) if s not in written]
    assert flat[:, untouched].isnan().all()  # nothing else was written, padding rows included


def test_write_kv_with_only_padding_changes_nothing() -> None:
    cache = _cache()
    cache[0, 0, 0] = 3.0  # slot 0 holds a value: rewriting it with itself must keep it
    before = cache.clone()
    write_kv(torch.randn(3, 2, 8), torch.randn(3, 2, 8), cache, torch.tensor([-1, -1, -1]))
    assert torch.equal(cache.isnan(), before.isnan()) and torch.equal(cache.nan_to_num(), before.nan_to_num())


def test_write_kv_refuses_mismatched_rows() -> None:
    with pytest.raises(ValueError, match=r"need one row per slot_mapping entry \(3\)"):
        write_kv(torch.randn(2, 2, 8), torch.randn(2, 2, 8), _cache(), torch.tensor([0, 1, 2]))


def test_base_backend_refuses_what_it_does_not_declare() -> None:
    class Mine(DenseAttentionBackend):
        name = "mine"
        capabilities = AttentionCapabilities(dtypes=frozenset({"float16"}), block_sizes=frozenset({16}), devices=frozenset({"cuda"}))

    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float32, block_size=8, device=torch.device("cpu"))
    with pytest.raises(UnsupportedError) as err:
        Mine(spec)
    assert err.value.reasons == ["dtype float32 not in {float16}", "block size 8 not in {16}", "device cpu not in {cuda}"]
    assert str(err.value).startswith("attention backend 'mine': ")
    with pytest.raises(UnsupportedError):
        require_spec("x", Mine.capabilities, spec)


def test_require_params_names_each_undeclared_field() -> None:
    caps = SamplerCapabilities(params=frozenset({"temperature"}))
    require_params("sampler 's'", caps, SamplingParams(temperature=0.5, max_tokens=3))  # engine fields are fine
    with pytest.raises(UnsupportedError) as err:
        require_params("sampler 's'", caps, SamplingParams(top_k=5, seed=3))
    assert err.value.reasons == ["seed=3 is not supported", "top_k=5 is not supported"]


def test_seeded_generator_depends_on_seed_and_step_only() -> None:
    draw = lambda seed, step: torch.rand(6, generator=seeded_generator(seed, step))  # noqa: E731
    assert torch.equal(draw(7, 2), draw(7, 2))
    assert not torch.equal(draw(7, 2), draw(7, 3)) and not torch.equal(draw(7, 2), draw(8, 2))
    assert torch.equal(draw(7, 2), torch.rand(6, generator=torch.Generator().manual_seed(row_seed(7, 2))))
    reused = torch.Generator()
    assert seeded_generator(7, 2, generator=reused) is reused and torch.equal(torch.rand(6, generator=reused), draw(7, 2))
    params = [SamplingParams(seed=1), SamplingParams(), SamplingParams(seed=9)]
    assert seeded_rows(params, [[4, 5], [1], []]) == [(0, 1, 2), (2, 9, 0)]


def test_gemma_blocks_from_the_sdk_equal_transformers_gemma2_in_float64() -> None:
    """A family outside corerun builds Gemma's GeGLU MLP and ``1 + weight`` norm from corerun.sdk.models alone,
    loads the checkpoint's tensors through each parameter's ``weight_loader`` and gets transformers' outputs."""
    from transformers import Gemma2Config
    from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP, Gemma2RMSNorm

    from corerun.sdk.models import ArchOptions, GemmaMLP, GemmaRMSNorm, ModelConfig

    g = torch.Generator().manual_seed(3)
    hf_config = Gemma2Config(hidden_size=16, intermediate_size=24, hidden_activation="gelu_pytorch_tanh", vocab_size=32,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    hf_mlp, hf_norm = Gemma2MLP(hf_config).double(), Gemma2RMSNorm(16, eps=1e-6).double()
    for p in [*hf_mlp.parameters(), *hf_norm.parameters()]:
        p.data = torch.randn(p.shape, generator=g, dtype=torch.float64)
    mlp = GemmaMLP(ModelConfig.from_dict(hf_config.to_dict()), ArchOptions()).double()
    gate_up = mlp.gate_up_proj.weight
    gate_up.weight_loader(gate_up, hf_mlp.gate_proj.weight.data, "gate")
    gate_up.weight_loader(gate_up, hf_mlp.up_proj.weight.data, "up")
    mlp.down_proj.weight.weight_loader(mlp.down_proj.weight, hf_mlp.down_proj.weight.data)
    norm = GemmaRMSNorm(16, 1e-6).double()
    norm.weight.weight_loader(norm.weight, hf_norm.weight.data)
    x = torch.randn(5, 16, generator=g, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), hf_mlp(x), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(norm(x), hf_norm(x), rtol=1e-6, atol=1e-6)  # both in float32 inside


def test_soft_cap_is_cap_times_tanh_and_config_caps_are_checked() -> None:
    from corerun.sdk.models import ModelConfig, UnsupportedModelError, config_soft_cap, soft_cap

    x = torch.randn(64, generator=torch.Generator().manual_seed(8), dtype=torch.float64) * 40
    e = torch.exp(2 * x / 30.0)
    torch.testing.assert_close(soft_cap(x, 30.0), 30.0 * (e - 1) / (e + 1), rtol=1e-12, atol=1e-12)
    assert soft_cap(x, 30.0).abs().max() < 30.0
    base = {"architectures": ["Gemma2ForCausalLM"], "hidden_size": 16, "intermediate_size": 24, "vocab_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    caps = {"final_logit_softcapping": 30, "attn_logit_softcapping": None}
    config = ModelConfig.from_dict({**base, **caps})
    assert config_soft_cap(config, "final_logit_softcapping") == 30.0
    assert config_soft_cap(config, "attn_logit_softcapping") is None and config_soft_cap(config, "absent_cap") is None
    for bad in (0, -5.0, True, "30"):
        with pytest.raises(UnsupportedModelError, match=rf"final_logit_softcapping must be a number above 0.*got {bad!r}"):
            config_soft_cap(ModelConfig.from_dict({**base, "final_logit_softcapping": bad}), "final_logit_softcapping")
