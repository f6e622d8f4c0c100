"""Gemma 2 and Gemma 3 (text): the model suite against transformers in float64 (GQA and MHA, tied and
untied), the suite rejecting Gemmas that miss one of their differences, and greedy tokens through the
engine equal to transformers' past the local layers' window."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from corerun import SamplingParams
from corerun.conformance import run
from corerun.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from corerun.models.layers import RMSNorm
from corerun.protocols.attention import AttentionSpec
from corerun.testing.engines import make_llm
from corerun.testing.tiny_models import hf_model, randomize_
from tests.test_sliding_models import _attention_backend, _hf_greedy

FAMILIES = ["Gemma2ForCausalLM", "Gemma3ForCausalLM"]


def _failed(results: list) -> dict[str, str]:
    return {f"{r.check}[{r.case}]": r.reason for r in results if r.outcome != "passed"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", FAMILIES)
def test_family_passes_the_model_suite(arch: str) -> None:
    results = run("model", arch, keyword="gqa-untied or (prefill and (mha-tied or mqa-untied))")
    assert len(results) == 10 and not _failed(results)  # 6 checks, and (chunked) prefill of two more shapes


class Gemma2WithoutAttentionSoftCap(Gemma2ForCausalLM):
    """Broken: the attention scores are not soft-capped (the final logits still are)."""

    hf_architecture = "Gemma2ForCausalLM"

    def attention_soft_cap(self) -> float | None:
        return None


class Gemma2WithoutQueryPreScaling(Gemma2ForCausalLM):
    """Broken: softmax scale ``head_dim ** -0.5`` instead of ``query_pre_attn_scalar ** -0.5``."""

    hf_architecture = "Gemma2ForCausalLM"

    def attention_spec(self, dtype: torch.dtype, block_size: int, device: torch.device | str) -> AttentionSpec:
        spec = super().attention_spec(dtype, block_size, device)
        return replace(spec, scale=None)


class Gemma3GlobalRopeEverywhere(Gemma3ForCausalLM):
    """Broken: the local layers rotate with the global layers' base and scaling."""

    hf_architecture = "Gemma3ForCausalLM"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.local_rotary = None


class Gemma3LlamaQKNorms(Gemma3ForCausalLM):
    """Broken: q/k norms scale by ``weight``, not ``1 + weight``."""

    hf_architecture = "Gemma3ForCausalLM"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.q_norm, attn.k_norm = RMSNorm(attn.head_dim, 1e-6), RMSNorm(attn.head_dim, 1e-6)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "broken", [Gemma2WithoutAttentionSoftCap, Gemma2WithoutQueryPreScaling, Gemma3GlobalRopeEverywhere, Gemma3LlamaQKNorms],
    ids=lambda c: c.__name__,
)
def test_broken_gemma_rejected(broken: type) -> None:
    failed = _failed(run("model", factory=broken, keyword="gqa-untied and (prefill or weights)"))
    assert "weights[gqa-untied]" not in failed  # every tensor loads: only the logits show the fault
    assert "differ from transformers" in failed["prefill[gqa-untied]"]


def _tiny_gemma(tmp_path: Path, arch: str) -> Path:
    import transformers

    cls = getattr(transformers, arch)
    keys = {**dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, bos_token_id=1, eos_token_id=2),
            **getattr(Gemma2ForCausalLM if arch.startswith("Gemma2") else Gemma3ForCausalLM, "conformance_config")}
    torch.manual_seed(0)
    model = cls(cls.config_class(**keys))
    randomize_(model, seed=2)
    folder = tmp_path / arch
    model.save_pretrained(folder)
    return folder


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_through_the_engine_equals_transformers(tmp_path: Path, arch: str) -> None:
    folder = _tiny_gemma(tmp_path, arch)
    hf_model(folder)  # transformers reads it back
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (11, 5)]  # past the window of 8, and into it
    want = _hf_greedy(folder, prompts, 10)
    with make_llm(folder, attention=_attention_backend(), scheduler={"max_num_batched_tokens": 6}) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_transformers_4_config_json_keys() -> None:
    """Gemma 3 1B's config.json as transformers 4 wrote it: no layer_types, the local base and the
    pattern as their own keys; Gemma 2's: alternating layers from layer 0."""
    from corerun.models.config import ModelConfig

    common = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                  vocab_size=128, max_position_embeddings=32768, sliding_window=512, query_pre_attn_scalar=16)
    gemma3 = ModelConfig.from_dict({**common, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 7,
                                    "rope_theta": 1000000, "rope_local_base_freq": 10000, "sliding_window_pattern": 6,
                                    "rope_scaling": None, "hidden_activation": "gelu_pytorch_tanh"})
    assert Gemma3ForCausalLM.layer_windows(gemma3) == (512,) * 5 + (None, 512)
    assert (gemma3.rope.theta, gemma3.local_rope.theta) == (1e6, 1e4)
    gemma2 = ModelConfig.from_dict({**common, "architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 4,
                                    "hidden_act": "gelu_pytorch_tanh", "attn_logit_softcapping": 50.0})
    assert Gemma2ForCausalLM.layer_windows(gemma2) == (512, None, 512, None)
    model = Gemma2ForCausalLM(gemma2)
    spec = model.attention_spec(torch.float32, 16, "cpu")
    assert (spec.logits_soft_cap, spec.sliding_windows, spec.softmax_scale) == (50.0, (512, None, 512, None), 0.25)
    assert model.final_soft_cap is None and model.local_rotary is None
