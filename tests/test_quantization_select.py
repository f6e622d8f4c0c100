"""The quantization kind: the hook, built-ins registered through it, `auto` from the checkpoint, refusals."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from corerun import hookimpl
from corerun.plugin.capabilities import QuantizationCapabilities
from corerun.errors import PluginUnavailableError
from corerun.quantization.capabilities import GGUF_TYPES
from corerun.quantization.checkpoint import CheckpointFormat, checkpoint_format
from corerun.quantization.gguf_blocks import LAYOUTS
from corerun.plugin.registry import Registry


class MinePlugin:
    @hookimpl
    def corerun_quantization_methods(self, register: Any) -> None:
        register("mine", "corerun.quantization.dense:DenseMethod",
                 capabilities=QuantizationCapabilities(quant_methods=frozenset({"awq"}), bits=frozenset({4.0})))


@pytest.fixture
def registry() -> Registry:
    reg = Registry.from_environment(allow=[])
    reg.register_module(MinePlugin(), plugin="mine", distribution="corerun-quantization-mine", version="0.1")
    return reg


def test_hook_corerun_quantization_methods(registry: Registry) -> None:
    assert registry.names("quantization") == ["awq", "compressed-tensors", "fp8", "gguf", "gptq", "mine", "none"]
    assert registry.get("quantization", "gguf").origin == "built-in"
    awq = CheckpointFormat("cpu", quant_method="awq")
    assert registry.get("quantization", "mine").capabilities.fits(awq) == []
    assert registry.get("quantization", "gguf").capabilities.fits(awq) != []


def test_gguf_types_listed_without_torch_are_the_decoded_ones() -> None:
    assert GGUF_TYPES == frozenset(LAYOUTS)


def test_auto_picks_from_the_checkpoint() -> None:
    reg = Registry.from_environment(allow=[])
    assert reg.select("quantization", "auto", CheckpointFormat("cpu", gguf_types=frozenset({"Q4_1", "F32"}))).name == "gguf"
    assert reg.select("quantization", "auto", CheckpointFormat("cpu")).name == "none"
    # a GGUF file read dense: every tensor dequantized at load
    assert reg.select("quantization", "none", CheckpointFormat("cpu", gguf_types=frozenset({"Q6_K"}))).name == "none"


def test_a_name_that_cannot_read_the_checkpoint_is_refused_naming_what_it_reads() -> None:
    reg = Registry.from_environment(allow=[])
    with pytest.raises(PluginUnavailableError, match=r"quant_method is 'gptq'; it reads GGUF tensor types \{BF16, F16, F32, Q4_0"):
        reg.select("quantization", "gguf", CheckpointFormat("cpu", quant_method="gptq"))
    with pytest.raises(PluginUnavailableError, match=r"the checkpoint is not quantized; it reads GGUF tensor types"):
        reg.select("quantization", "gguf", CheckpointFormat("cpu"))
    with pytest.raises(PluginUnavailableError, match=r"(?s)auto.*gptq: the checkpoint's quantization_config.quant_method is 'bitsandbytes'"):
        reg.select("quantization", "auto", CheckpointFormat("cpu", quant_method="bitsandbytes"))
    with pytest.raises(PluginUnavailableError, match=r"quant_method is 'awq'; it reads quantization_config.quant_method \{gptq\}"):
        reg.select("quantization", "gptq", CheckpointFormat("cpu", quant_method="awq"))


@pytest.mark.parametrize("quant_method", ["gptq", "awq", "compressed-tensors", "fp8"])
def test_auto_picks_the_builtin_that_reads_each_quant_method(quant_method: str) -> None:
    reg = Registry.from_environment(allow=[])
    assert reg.select("quantization", "auto", CheckpointFormat("cpu", quant_method=quant_method)).name == quant_method


@pytest.mark.parametrize("quant_method,name", [("gptq", "gptq_cpu"), ("awq", "awq_cpu"), ("compressed-tensors", "compressed_tensors_cpu")])
def test_auto_prefers_corerun_quant_cpus_kernels_where_they_run(quant_method: str, name: str) -> None:
    reg = Registry.from_environment()
    if name not in reg.registrations["quantization"] or reg.get("quantization", name).unavailable_reasons():
        pytest.skip(f"{name} is not installed or cannot run here")
    for dtype in ("float32", "bfloat16"):
        assert reg.select("quantization", "auto", CheckpointFormat("cpu", quant_method=quant_method, dtype=dtype)).name == name
    assert reg.select("quantization", "auto", CheckpointFormat("cuda", quant_method=quant_method)).name == quant_method


def test_checkpoint_format_reads_config_json(tmp_path: Any) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq", "bits": 4}}))
    assert checkpoint_format(tmp_path, "cpu") == CheckpointFormat("cpu", quant_method="awq")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert checkpoint_format(tmp_path, "cpu") == CheckpointFormat("cpu")


def test_the_model_dtype_is_checked_against_activation_dtypes(tmp_path: Any) -> None:
    bf16_only = QuantizationCapabilities(dense=True, activation_dtypes=frozenset({"bfloat16"}))
    assert bf16_only.fits(CheckpointFormat("cpu", dtype="bfloat16")) == []
    assert bf16_only.fits(CheckpointFormat("cpu")) == []  # dtype not known: not checked
    assert bf16_only.fits(CheckpointFormat("cpu", dtype="float32")) == ["the model runs in float32; its layers take {bfloat16}"]
    reg = Registry.from_environment(allow=[])
    assert reg.select("quantization", "auto", CheckpointFormat("cpu", dtype="float32")).name == "none"
    with pytest.raises(PluginUnavailableError, match=r"the model runs in float64; its layers take \{bfloat16, float16, float32\}"):
        reg.select("quantization", "gptq", CheckpointFormat("cpu", quant_method="gptq", dtype="float64"))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert checkpoint_format(tmp_path, "cpu", "bfloat16") == CheckpointFormat("cpu", dtype="bfloat16")


def test_select_quantization_hands_the_run_dtype(tmp_path: Any) -> None:
    from types import SimpleNamespace

    from corerun.runner.construction import _run_dtype

    runner = SimpleNamespace(config=SimpleNamespace(dtype="auto"), model_dir=tmp_path)
    assert _run_dtype(runner, torch.device("cpu")) == "float32"  # auto on CPU
    runner.config.dtype = "bfloat16"
    assert _run_dtype(runner, torch.device("cpu")) == "bfloat16"


@pytest.mark.parametrize("name", ["gguf", "gguf_cpu"])
def test_a_gguf_method_runs_the_default_model_from_its_shipped_file(name: str) -> None:
    from corerun.config import Config
    from corerun.models.default import find_default_gguf
    from corerun.models.gguf_convert import gguf_model_dir
    from corerun.runner.construction import model_dir_for

    if name not in Registry.from_environment().registrations["quantization"]:
        pytest.skip(f"{name} is not installed here")
    assert model_dir_for(Config(quantization={"name": name})) == gguf_model_dir(find_default_gguf())
    # a dense method and auto keep the converted float folder
    assert "bfloat16" in model_dir_for(Config(quantization={"name": "auto"})).name
