"""PEFT folders read for one tensor-parallel rank: each rank keeps its rows of B (column-parallel layers)
or its columns of A (row-parallel layers), and the scaling folds rank_pattern / alpha_pattern into B."""

from __future__ import annotations

import json
import math

import pytest
import torch

from corerun.lora.layers import LoRATarget, SliceSpec
from corerun.lora.peft import LoRAError, load_adapter
from corerun.lora.request import LoRARequest

H, Q, KV, R = 16, 16, 8, 4
PREFIX = "base_model.model.model.layers.0"


def _rank_one_of_two() -> dict[str, LoRATarget]:
    """Rank 1 of 2: the second half of q's and k/v's rows, and the second half of o_proj's input columns."""
    qkv = LoRATarget("model.layers.0.self_attn.qkv_proj", H, 0, H, (
        SliceSpec("q_proj", Q // 2, Q // 2, Q), SliceSpec("k_proj", KV // 2, KV // 2, KV), SliceSpec("v_proj", KV // 2, KV // 2, KV)))
    o = LoRATarget("model.layers.0.self_attn.o_proj", Q, Q // 2, Q // 2, (SliceSpec("o_proj", 0, H, H),))
    return {t.name: t for t in (qkv, o)}


def _folder(tmp_path, tensors: dict[str, torch.Tensor], **config) -> LoRARequest:
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": R, "lora_alpha": 8, **config}))
    return LoRARequest("tp", 1, str(tmp_path))


def test_each_rank_keeps_its_share_and_patterns_fold_into_b(tmp_path):
    g = torch.Generator().manual_seed(3)
    full = {
        "q_proj": (torch.randn(R, H, generator=g), torch.randn(Q, R, generator=g)),
        "v_proj": (torch.randn(2, H, generator=g), torch.randn(KV, 2, generator=g)),  # rank 2 by rank_pattern
        "o_proj": (torch.randn(R, Q, generator=g), torch.randn(H, R, generator=g)),
    }
    tensors = {f"{PREFIX}.self_attn.{m}.lora_{k}.weight": t for m, (a, b) in full.items() for k, t in zip("AB", (a, b))}
    req = _folder(tmp_path, tensors, use_rslora=True, rank_pattern={"v_proj": 2}, alpha_pattern={"o_proj": 2})
    w = load_adapter(req, _rank_one_of_two(), max_rank=4)
    assert w.scaling == pytest.approx(8 / math.sqrt(R)) and w.rank == R
    q, k, v = w.layers["model.layers.0.self_attn.qkv_proj"]
    assert k is None  # not targeted: the slot's slice stays zero
    assert torch.equal(q[0], full["q_proj"][0]) and torch.equal(q[1], full["q_proj"][1][Q // 2:])
    v_ratio = (8 / math.sqrt(2)) / (8 / math.sqrt(R))
    assert torch.equal(v[0], full["v_proj"][0])
    torch.testing.assert_close(v[1], full["v_proj"][1][KV // 2:] * v_ratio)
    (o,) = w.layers["model.layers.0.self_attn.o_proj"]
    torch.testing.assert_close(o[0], full["o_proj"][0][:, Q // 2:])  # this rank's input columns of A
    torch.testing.assert_close(o[1], full["o_proj"][1] * (2 / 8))  # alpha 2 instead of 8, same rank


def test_a_b_pair_missing_its_half_is_refused_by_name(tmp_path):
    req = _folder(tmp_path, {f"{PREFIX}.self_attn.q_proj.lora_A.weight": torch.randn(R, H)})
    with pytest.raises(LoRAError, match=r"module 'model.layers.0.self_attn.q_proj' has lora_A but not both"):
        load_adapter(req, _rank_one_of_two(), max_rank=4)
