"""GPTQ, AWQ, compressed-tensors and FP8 checkpoints of a tiny random Qwen2 (q/k/v biases, merged q/k/v and
gate/up): corerun, with the method for the checkpoint's quant_method, against transformers running the float
model with the reference quantizer's dequantized weights (and, for W8A8, its activations fake-quantized
per token, as the int8 product sees them).  The parts of each layer are split over two safetensors files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from corerun.conformance.reference.quantizers import FORMATS
from corerun.models.loader import load_model
from corerun.quantization.checkpoint import checkpoint_format
from corerun.quantization.packed_method import AWQMethod, CompressedTensorsMethod, FP8Method, GPTQMethod
from corerun.quantization.readers import QuantizedLoadError
from tests.helpers.tiny_models import corerun_logits, hf_model, make_tiny_model, max_rel_err

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

IDS = [5, 17, 99, 3, 250, 42, 7, 128, 64, 11]
METHODS = {m.quant_method: m for m in (GPTQMethod, AWQMethod, CompressedTensorsMethod, FP8Method)}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("float"), arch="qwen2")


def write_quantized(float_dir: Path, fmt: str, out: Path) -> dict[str, torch.Tensor]:
    """``float_dir`` with every projection quantized by the reference ``fmt``, in two shards (scales in
    the second); returns the dequantized float64 weight of each projection by its float name."""
    state, dequantized, config = load_file(str(float_dir / "model.safetensors")), {}, None
    for name in [n for n in state if n.endswith("proj.weight") and n.split(".")[-2] in PROJECTIONS]:
        ref = FORMATS[fmt].quantize(state.pop(name).double())
        prefix = name.removesuffix(".weight")
        state.update({f"{prefix}.{k}": t for k, t in ref.tensors.items()})
        dequantized[name], config = ref.weight, ref.config
    out.mkdir()
    second = {n: t for n, t in state.items() if "scale" in n}
    first = {n: t for n, t in state.items() if n not in second}
    save_file(first, str(out / "model-00001-of-00002.safetensors"))
    save_file(second, str(out / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {**{n: "model-00001-of-00002.safetensors" for n in first}, **{n: "model-00002-of-00002.safetensors" for n in second}}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((float_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": config}))
    return dequantized


def reference_model(float_dir: Path, dequantized: dict[str, torch.Tensor], activations_int8: bool) -> torch.nn.Module:
    """transformers' model of ``float_dir`` with the ``dequantized`` weights (and W8A8's activations)."""
    hf = hf_model(float_dir)
    with torch.no_grad():
        params = dict(hf.named_parameters())
        for name, w in dequantized.items():
            params[name].copy_(w.float())
    if activations_int8:  # the W8A8 product: each input row rounded to its own int8 grid, max|x| / 127
        def fake_quantize(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
            x = args[0]
            s = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
            return (torch.round(x / s).clamp(-127, 127) * s,)

        for name, module in hf.named_modules():
            if name.split(".")[-1] in PROJECTIONS:
                module.register_forward_pre_hook(fake_quantize)
    return hf


def reference_logits(float_dir: Path, dequantized: dict[str, torch.Tensor], activations_int8: bool) -> torch.Tensor:
    with torch.no_grad():
        return reference_model(float_dir, dequantized, activations_int8)(torch.tensor([IDS])).logits[0].float()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["gptq-4bit-g32-act-order", "awq-4bit-g32", "ct-w4a16-channel-asym", "ct-w8a8-int8", "fp8-tensor"])
def test_quantized_checkpoint_matches_transformers_on_the_dequantized_weights(float_dir: Path, tmp_path: Path, fmt: str) -> None:
    folder = tmp_path / fmt
    dequantized = write_quantized(float_dir, fmt, folder)
    found = checkpoint_format(folder, "cpu").quant_method
    assert found == FORMATS[fmt].quant_method
    model, _ = load_model(folder, dtype=torch.float32, quant=METHODS[found]())
    got = corerun_logits(model, IDS)
    want = reference_logits(float_dir, dequantized, fmt == "ct-w8a8-int8")
    assert max_rel_err(got, want) < 1e-4
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()  # greedy, position by position
    # the float model differs: the check above sees the quantized weights, not the float ones
    assert max_rel_err(got, reference_logits(float_dir, {}, False)) > 1e-3


def test_a_layer_missing_a_part_is_refused_naming_it(float_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "gptq"
    write_quantized(float_dir, "gptq-4bit-g32", folder)
    shard = folder / "model-00002-of-00002.safetensors"
    state = load_file(str(shard))
    del state["model.layers.1.mlp.down_proj.scales"]
    save_file(state, str(shard))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.down_proj.scales"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(QuantizedLoadError, match=r"model\.layers\.1\.mlp\.down_proj: GPTQ needs model\.layers\.1\.mlp\.down_proj\.scales"):
        load_model(folder, dtype=torch.float32, quant=GPTQMethod())


def test_an_unread_config_field_is_refused_naming_field_value_and_what_is_read() -> None:
    from corerun.quantization.readers import READERS

    with pytest.raises(QuantizedLoadError, match=r"quantization_config\.bits: 3 is not read by corerun; it reads 4, 8"):
        READERS["gptq"]({"bits": 3})
    assert READERS["awq"]({"w_bit": 4, "q_group_size": 64, "zero_point": True, "version": "GEMM"}).group_size == 64  # older keys
    with pytest.raises(QuantizedLoadError, match=r"quantization_config\.weight_block_size: \[128, 128\]"):
        READERS["fp8"]({"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(QuantizedLoadError, match=r"config_groups\.group_0\.weights\.num_bits: 2"):
        READERS["compressed-tensors"]({"format": "pack-quantized", "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 2, "type": "int"}}}})


def _hf_greedy(float_dir: Path, dequantized: dict[str, torch.Tensor], tokens: int) -> list[int]:
    hf = hf_model(float_dir)
    with torch.no_grad():
        params = dict(hf.named_parameters())
        for name, w in dequantized.items():
            params[name].copy_(w.float())
        return hf.generate(torch.tensor([IDS]), max_new_tokens=tokens, do_sample=False)[0, len(IDS):].tolist()


def _auto_gptq() -> str:
    """What ``auto`` takes for a GPTQ folder on CPU: corerun-quant-cpu's ``gptq_cpu`` where it is installed and runs."""
    from corerun.plugin.registry import Registry

    reg = Registry.from_environment()
    ok = "gptq_cpu" in reg.registrations["quantization"] and not reg.get("quantization", "gptq_cpu").unavailable_reasons()
    return "gptq_cpu" if ok else "gptq"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("fmt", "ranks"), [("gptq-4bit-g32", 1), ("gptq-4bit-g32-act-order", 2)])
def test_an_engine_reads_a_gptq_folder_with_quantization_auto(float_dir: Path, tmp_path: Path, fmt: str, ranks: int) -> None:
    """Two ranks: each keeps its output columns of q/k/v and gate/up, and its input rows of o_proj and
    down_proj (qweight's packed words, the g_idx slice, every group's scales)."""
    from corerun import SamplingParams
    from corerun.testing import make_llm

    folder = tmp_path / fmt
    want = _hf_greedy(float_dir, write_quantized(float_dir, fmt, folder), 4)
    extra = {"tensor_parallel_size": ranks, "distributed": {"start_method": "forkserver"}} if ranks > 1 else {}
    with make_llm(folder, quantization="auto", **extra) as llm:
        assert llm.engine.runner.quantization_name == _auto_gptq()
        out = llm.generate([IDS], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == want


def test_actorder_weight_needs_no_g_idx() -> None:
    """llm-compressor's actorder "weight" (alias "static") only reorders calibration: no weight_g_idx is written."""
    import copy

    from corerun.quantization.readers import READERS, group_weights

    ref = FORMATS["ct-w4a16-g32"].make(8, 96, 1)
    for actorder in ("weight", "static"):
        config = copy.deepcopy(ref.config)
        config["config_groups"]["group_0"]["weights"]["actorder"] = actorder
        out = list(group_weights(((f"m.q_proj.{k}", t) for k, t in ref.tensors.items()), READERS["compressed-tensors"](config)))
        assert [name for name, _ in out] == ["m.q_proj.weight"]
        assert torch.allclose(out[0][1].dequantize().double(), ref.weight, rtol=0, atol=1e-6)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("product", ["default", "onednn"])
def test_an_engine_runs_a_w8a8_folder_greedy_as_transformers(float_dir: Path, tmp_path: Path, product: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """W8A8 through the engine: greedy tokens equal transformers' on the dequantized weights with the
    activations fake-quantized per token.  ``onednn``: every weight packed for oneDNN's int8 GEMM (the
    tiny model's are below the size that takes it by default), merged q/k/v and gate/up included."""
    from corerun import SamplingParams
    from corerun.quantization import int8_matmul
    from corerun.testing import make_llm

    if product == "onednn":
        if "onednn" not in int8_matmul.cpu_int8_paths():
            pytest.skip("oneDNN's int8 GEMM is not exact here (no VNNI or AMX), so W8A8 does not use it")
        monkeypatch.setattr(int8_matmul, "SMALL_PRODUCT", 0)
    folder = tmp_path / "w8a8"
    dequantized = write_quantized(float_dir, "ct-w8a8-int8", folder)
    with torch.no_grad():
        want = reference_model(float_dir, dequantized, True).generate(torch.tensor([IDS]), max_new_tokens=6, do_sample=False)[0, len(IDS):].tolist()
    with make_llm(folder, quantization="compressed-tensors") as llm:  # the built-in by name (auto may take corerun-quant-cpu's)
        qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
        assert (qkv.int8.packed is not None) == (product == "onednn")
        merged = qkv.int8.weight.untyped_storage().data_ptr()  # q, k and v's codes: views of the merged ones, one copy
        assert [s.parts["weight"].untyped_storage().data_ptr() for s in qkv.quantized.values()] == [merged] * 3
        out = llm.generate([IDS], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == want
