"""Weight loading: file formats, merged q/k/v and gate/up shards, and the errors for folders that do not fit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from corerun.models import ModelLoadError, UnsupportedModelError, load_model
from corerun.models.layers import MergedLinear, WeightShapeError
from tests.helpers.tiny_models import corerun_logits, hf_logits, make_tiny_model, max_rel_err

IDS = [5, 17, 3, 99, 200, 42, 7, 255, 0, 64, 128]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def reference(llama_dir):
    return hf_logits(llama_dir, IDS)


def _copy_without_weights(src, dst):
    """``dst`` gets ``src``'s config.json only."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def _rewrite(folder, edit):
    """Apply ``edit(state_dict)`` to the folder's model.safetensors."""
    path = folder / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path), metadata={"format": "pt"})


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_merged_linear_shards_land_in_their_rows():
    with torch.device("cpu"):
        layer = MergedLinear(3, {"q": 4, "k": 2, "v": 2}, bias=True)
    parts = {s: torch.randn(n, 3) for s, n in (("q", 4), ("k", 2), ("v", 2))}
    biases = {s: torch.randn(len(w)) for s, w in parts.items()}
    for shard in ("v", "q", "k"):  # any order
        layer.weight.weight_loader(layer.weight, parts[shard], shard)
        layer.bias.weight_loader(layer.bias, biases[shard], shard)
    assert torch.equal(layer.weight, torch.cat([parts["q"], parts["k"], parts["v"]]))
    assert torch.equal(layer.bias, torch.cat([biases["q"], biases["k"], biases["v"]]))
    x = torch.randn(5, 3, dtype=torch.float64)
    q, k, v = layer.split(layer(x.float()))
    assert torch.allclose(k.double(), x @ parts["k"].double().T + biases["k"].double(), rtol=1e-5, atol=1e-6)
    with pytest.raises(WeightShapeError, match=r"expected shape \(2, 3\), checkpoint has \(4, 3\)"):
        layer.weight.weight_loader(layer.weight, parts["q"], "k")


def test_sharded_safetensors(tmp_path, reference):
    folder = make_tiny_model(tmp_path, "llama", max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 3 and not (folder / "model.safetensors").exists()
    (folder / "stray.safetensors").write_bytes(b"not read: the index names the files")
    model, _ = load_model(folder, dtype="float32")
    assert max_rel_err(corerun_logits(model, IDS), reference) < 1e-5  # same seed, same weights


def test_sharded_with_a_missing_shard(tmp_path):
    folder = make_tiny_model(tmp_path, "llama", max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (folder / gone).unlink()
    with pytest.raises(ModelLoadError, match=f"names shards that are missing: {gone}"):
        load_model(folder)


def test_pickle_weights_refused_unless_allowed(tmp_path, llama_dir, reference):
    folder = _copy_without_weights(llama_dir, tmp_path / "bin")
    torch.save(load_file(str(llama_dir / "model.safetensors")), folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError) as exc:
        load_model(folder)
    msg = str(exc.value)
    assert str(folder) in msg and "pytorch_model.bin" in msg and "allow_pickle" in msg and "safetensors" in msg
    model, _ = load_model(folder, dtype="float32", allow_pickle=True)
    assert max_rel_err(corerun_logits(model, IDS), reference) < 1e-5


def test_missing_config(tmp_path, llama_dir):
    folder = tmp_path / "noconfig"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((llama_dir / "model.safetensors").read_bytes())
    with pytest.raises(ModelLoadError, match=rf"{folder} has no config.json.*found: model.safetensors"):
        load_model(folder)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_missing_weights_files(tmp_path, llama_dir):
    folder = _copy_without_weights(llama_dir, tmp_path / "empty")
    with pytest.raises(ModelLoadError, match=rf"{folder} has no weights: expected model.safetensors.*found: config.json"):
        load_model(folder)
    (folder / "model.Q4_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="gguf_file"):
        load_model(folder)


def test_missing_and_unexpected_weights_are_listed(tmp_path, llama_dir):
    folder = _copy(llama_dir, tmp_path / "edited")

    def edit(state):
        del state["model.layers.1.mlp.up_proj.weight"]
        del state["model.layers.0.self_attn.k_proj.weight"]
        del state["model.norm.weight"]
        state["model.layers.0.self_attn.extra.weight"] = torch.randn(3, 3)
        state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.randn(8)  # ignored

    _rewrite(folder, edit)
    with pytest.raises(ModelLoadError) as exc:
        load_model(folder)
    msg = str(exc.value)
    assert "missing weights (3)" in msg and "unexpected weights (1)" in msg
    for name in ("model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.weight", "model.norm.weight",
                 "model.layers.0.self_attn.extra.weight (3, 3)"):
        assert name in msg
    assert "inv_freq" not in msg and "gate_proj" not in msg


def test_rotary_buffers_in_checkpoint_are_ignored(tmp_path, llama_dir, reference):
    folder = _copy(llama_dir, tmp_path / "inv_freq")
    _rewrite(folder, lambda s: s.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.randn(8) for i in range(2)}))
    model, _ = load_model(folder, dtype="float32")
    assert max_rel_err(corerun_logits(model, IDS), reference) < 1e-5


def test_shape_mismatch_names_parameter_and_shapes(tmp_path, llama_dir):
    folder = _copy(llama_dir, tmp_path / "shapes")
    _edit_config(folder, intermediate_size=96)
    with pytest.raises(ModelLoadError) as exc:
        load_model(folder)
    msg = str(exc.value)
    assert ("model.layers.0.mlp.gate_proj.weight -> model.layers.0.mlp.gate_up_proj.weight (shard 'gate'): "
            "corerun expects (96, 64), the checkpoint has (128, 64)") in msg
    assert "model.layers.1.mlp.down_proj.weight -> model.layers.1.mlp.down_proj.weight: corerun expects (64, 96)" in msg
    assert "missing weights" not in msg, msg  # a mis-shaped weight is reported once, as a mismatch


@pytest.mark.parametrize(
    "arch, expected_missing",
    [
        ("Qwen3ForCausalLM", ["model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"]),
        ("Qwen2ForCausalLM", ["model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.v_proj.bias"]),
    ],
)
def test_architecture_mismatch(tmp_path, llama_dir, arch, expected_missing):
    folder = _copy(llama_dir, tmp_path / "arch")
    _edit_config(folder, architectures=[arch])
    with pytest.raises(ModelLoadError, match=f"into {arch}") as exc:
        load_model(folder)
    for name in expected_missing:
        assert name in str(exc.value)


def test_untied_config_without_lm_head(tmp_path, llama_dir):
    folder = _copy(llama_dir, tmp_path / "nohead")
    _rewrite(folder, lambda s: s.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError, match=r"missing weights \(1\):\n    lm_head.weight"):
        load_model(folder)


def test_unsupported_architecture_in_folder(tmp_path, llama_dir):
    folder = _copy(llama_dir, tmp_path / "gpt2")
    _edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match=r"architectures \[GPT2LMHeadModel\] .*not supported") as info:
        load_model(folder)
    from corerun.plugin.registry import get_registry

    families = str(info.value).partition("installed model families: ")[2]
    assert "LlamaForCausalLM (corerun)" in families, str(info.value)
    assert all(f"{name} (" in families for name in get_registry().names("model")), str(info.value)
