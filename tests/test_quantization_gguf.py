"""GGUF blocks decoded by corerun against the ``gguf`` package's own numpy decoder, and load errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from corerun.models.layers import Linear, MergedLinear, WeightShapeError
from corerun.quantization.gguf_blocks import LAYOUTS, QUANTIZED, dequantize
from corerun.quantization.gguf_method import GGUFMethod
from corerun.quantization.gguf_tensor import GGUFLoadError, GGUFTensor

gguf = pytest.importorskip("gguf")


def _random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes with sane float16 scales (random bytes there could be inf or nan)."""
    layout = LAYOUTS[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // layout.block_size * layout.type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, layout.type_size)
    halves = rng.uniform(-0.05, 0.05, size=(blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if type_name == "Q6_K":
        blocks[:, 208:210] = halves[:, 0:2]
    else:
        blocks[:, 0:2] = halves[:, 0:2]
        if type_name in ("Q4_1", "Q4_K", "Q5_K"):
            blocks[:, 2:4] = halves[:, 2:4]
    return raw


@pytest.mark.parametrize("type_name", sorted(QUANTIZED))
def test_blocks_decode_as_the_gguf_package_does(type_name):
    raw = _random_blocks(type_name, 3, 512)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    got = dequantize(torch.from_numpy(raw), type_name, 512).numpy()
    np.testing.assert_array_equal(got, expected)


def test_gguf_layer_multiplies_by_the_decoded_weight():
    raw = _random_blocks("Q4_K", 24, 256, seed=1)
    ref_w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)).double()
    layer = MergedLinear(256, {"q": 16, "k": 8}, quant=GGUFMethod())
    whole = GGUFTensor("blk.0.attn_q.weight", "Q4_K", torch.from_numpy(raw), 256)
    layer.weight.weight_loader(layer.weight, whole.narrow(0, 0, 16), "q")
    layer.weight.weight_loader(layer.weight, whole.narrow(0, 16, 8), "k")
    x = torch.randn(5, 256, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ ref_w.T, rtol=1e-6, atol=1e-6)


def test_load_errors_name_the_tensor_and_type():
    with pytest.raises(GGUFLoadError, match=r"blk\.3\.ffn_up\.weight \(Q8_0\).*not a multiple of the block size 32"):
        GGUFTensor("blk.3.ffn_up.weight", "Q8_0", torch.zeros(2, 34, dtype=torch.uint8), 40)
    with pytest.raises(GGUFLoadError, match=r"blk\.0\.attn_q\.weight \(Q4_K\): columns \[0, 128\) do not fall on its blocks of 256"):
        GGUFTensor("blk.0.attn_q.weight", "Q4_K", torch.zeros(2, 144, dtype=torch.uint8), 256).narrow(1, 0, 128)
    with pytest.raises(GGUFLoadError, match=r"output\.weight: type Q2_K is not read by corerun; it reads F32"):
        GGUFTensor("output.weight", "Q2_K", torch.zeros(2, 84, dtype=torch.uint8), 256)
    layer = Linear(64, 4, quant=GGUFMethod())
    with pytest.raises(WeightShapeError, match=r"expected shape \(4, 64\), checkpoint has \(3, 64\)"):
        layer.weight.weight_loader(layer.weight, GGUFTensor("t", "Q8_0", torch.zeros(3, 68, dtype=torch.uint8), 64))
