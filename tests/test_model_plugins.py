"""The ``model`` plugin kind: architectures registered through ``corerun_models``, built-ins included."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import corerun.plugin.registry as registry_module
from corerun import hookimpl
from corerun.plugin.capabilities import ModelCapabilities, Need
from corerun.models import UnsupportedModelError, load_model, model_family, supported_architectures
from corerun.models.config import ModelConfig
from corerun.plugin.registry import Registry
from corerun.sdk.models import ArchOptions, LlamaForCausalLM
from corerun.testing.tiny_models import corerun_logits, hf_logits, make_tiny_model, max_rel_err


class PluginLlama(LlamaForCausalLM):
    """A third-party family: Llama's layers, registered under an architecture of its own."""

    @classmethod
    def arch_options(cls, config: ModelConfig) -> ArchOptions:
        return ArchOptions()


class Plugin:
    @hookimpl
    def corerun_models(self, register: Any) -> None:
        register("PluginLlamaForCausalLM", PluginLlama, capabilities=ModelCapabilities(tensor_parallel=False),
                 description="a test family")


@pytest.fixture
def plugin_registry(monkeypatch: pytest.MonkeyPatch) -> Registry:
    reg = Registry.from_environment(allow=[])
    reg.register_module(Plugin(), plugin="model_mine", distribution="corerun-model-mine", version="0.1")
    monkeypatch.setattr(registry_module, "_default", reg)
    return reg


def test_hook_corerun_models(plugin_registry: Registry, tmp_path: Any) -> None:
    """A folder naming the plugin's architecture loads through the plugin's class, and matches transformers."""
    folder = make_tiny_model(tmp_path, "llama")
    cfg_path = folder / "config.json"
    hf = hf_logits(folder, list(range(3, 20)))
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["PluginLlamaForCausalLM"]
    cfg_path.write_text(json.dumps(cfg))
    model, config = load_model(folder)
    assert type(model) is PluginLlama
    assert max_rel_err(corerun_logits(model, list(range(3, 20))), hf) < 1e-5
    family = model_family(config)
    assert family.registration.distribution == "corerun-model-mine"
    assert family.capabilities.fits(Need("cpu", tensor_parallel=True)) != []


def test_builtin_families_register_through_the_hook() -> None:
    reg = Registry.from_environment(allow=[])
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        r = reg.get("model", arch)
        assert r.origin == "built-in" and r.capabilities.tensor_parallel
        assert r.to_dict(False)["capabilities"]["attention"] == ["full", "sliding"]  # as config.json says, per layer


def test_unsupported_architecture_lists_installed_with_distributions(plugin_registry: Registry) -> None:
    config = ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "hidden_size": 8,
                                    "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                    "vocab_size": 10})
    with pytest.raises(UnsupportedModelError) as exc:
        model_family(config)
    msg = str(exc.value)
    assert "GPT2LMHeadModel" in msg
    assert "PluginLlamaForCausalLM (corerun-model-mine)" in msg
    assert "LlamaForCausalLM (corerun)" in msg
    assert "PluginLlamaForCausalLM" in supported_architectures()


def test_capabilities_refuse_unknown_attention_kind() -> None:
    with pytest.raises(ValueError, match="'?local'?.*full, sliding"):
        ModelCapabilities(attention=frozenset({"local"}))


def test_model_kind_in_plugins_listing() -> None:
    from corerun.cli.plugins import describe

    doc = describe(Registry.from_environment(allow=[]), probe=False)
    kinds = {(i["kind"], i["name"]) for i in doc["implementations"]}
    assert ("model", "Qwen3ForCausalLM") in kinds


def test_tp_refused_for_family_declaring_none(plugin_registry: Registry, tmp_path: Any) -> None:
    folder = make_tiny_model(tmp_path, "llama")
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["PluginLlamaForCausalLM"]
    cfg_path.write_text(json.dumps(cfg))

    class FakeGroup:
        rank, world_size = 0, 2

    with pytest.raises(UnsupportedModelError, match="PluginLlamaForCausalLM.*tensor_parallel=False"):
        load_model(folder, tp=FakeGroup())  # type: ignore[arg-type]
