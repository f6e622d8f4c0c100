"""``corerun quantize``: a tiny random Llama written as compressed-tensors int8 (W8A8) and int4 (W4A16),
read back by corerun (logits against the float model within the format's bound) and by
compressed-tensors' own decompressor (the same dequantized weights as corerun's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from corerun.cli import cli
from corerun.models.loader import load_model
from corerun.quantization.checkpoint import checkpoint_format
from corerun.quantization.packed_method import CompressedTensorsMethod
from tests.helpers.tiny_models import corerun_logits, hf_logits, make_tiny_model, max_rel_err

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

IDS = [5, 17, 99, 3, 250, 42, 7, 128, 64, 11]
LAYERS = 2
# relative error of one product: int8 weights and activations each within half a step of max|.| / 127;
# int4 weights within half a step of max|w_g| / 7.5.  Four products in sequence per layer (q/k/v, o,
# gate/up, down) each add at most that, relative to the residual stream.
PER_PRODUCT = {"int8": 2 * 0.5 / 127, "int4": 0.5 / 7.5}


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("float"), arch="llama", num_hidden_layers=LAYERS)


def _quantize(float_dir: Path, out: Path, method: str, *extra: str) -> dict:
    args = ["quantize", str(float_dir), "--method", method, "--out", str(out), "--group-size", "32", *extra]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    return json.loads((out / "config.json").read_text())["quantization_config"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("method", "extra"), [("int8", ()), ("int4", ()), ("int4", ("--asymmetric",))])
def test_quantize_writes_compressed_tensors_that_corerun_reads(float_dir: Path, tmp_path: Path, method: str, extra: tuple) -> None:
    out = tmp_path / method
    config = _quantize(float_dir, out, method, *extra)
    assert config["quant_method"] == "compressed-tensors"
    assert checkpoint_format(out, "cpu").quant_method == "compressed-tensors"
    model, _ = load_model(out, dtype=torch.float32, quant=CompressedTensorsMethod())
    err = max_rel_err(corerun_logits(model, IDS), hf_logits(float_dir, IDS))
    assert 0 < err < 4 * LAYERS * PER_PRODUCT[method]

    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    scheme = QuantizationConfig.model_validate(config).config_groups["group_0"]
    compressor = BaseCompressor.load_from_registry(config["format"])
    state, original = load_file(str(out / "model.safetensors")), load_file(str(float_dir / "model.safetensors"))
    prefix = "model.layers.1.mlp.down_proj"
    theirs = compressor.decompress({k.removeprefix(prefix + "."): v for k, v in state.items() if k.startswith(prefix + ".")}, scheme)["weight"]
    ours = model.model.layers[1].mlp.down_proj.quant.dequantized(model.model.layers[1].mlp.down_proj, torch.float32)
    assert torch.equal(theirs.float(), ours), f"compressed-tensors {ct.__version__} decodes {prefix} differently"
    scale = state[f"{prefix}.weight_scale"].float()
    step = scale.repeat_interleave(32, dim=1)[:, : ours.shape[1]] if method == "int4" else scale
    assert ((ours - original[f"{prefix}.weight"]).abs() <= step * 0.5 * (1 + 1e-5)).all()
    assert ("weight_zero_point" in compressor.compression_param_names(scheme)) == bool(extra)


def test_quantize_refuses_a_folder_that_holds_a_model(float_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    _quantize(float_dir, out, "int8")
    again = CliRunner().invoke(cli, ["quantize", str(float_dir), "--method", "int8", "--out", str(out)])
    assert again.exit_code != 0 and "already holds a model" in again.output
