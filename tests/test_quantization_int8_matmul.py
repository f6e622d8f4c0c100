"""W8A8's product on CPU: the int8 codes accumulated exactly (as int32 would), then scaled in float32, by
every product this CPU runs (oneDNN's int8 GEMM, ``torch._int_mm``, the float32 / float64 product of
the codes), on both sides of the width where float32 accumulation stops being exact (1032 input
features) and at the default model's shapes, against the float64 product of the codes."""

from __future__ import annotations

import pytest
import torch

from corerun.quantization import int8_matmul
from corerun.quantization.int8_matmul import EXACT_FLOAT32, PackedInt8, int8_linear, merge

PATHS = ["float", *int8_matmul.cpu_int8_paths()]
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # (out, in) of the default model's projections


def run(path: str, x, weight, w_scale, input_scale=None) -> torch.Tensor:
    """``int8_linear`` through ``path`` alone."""
    packed = PackedInt8.of(weight, w_scale) if path == "onednn" else None
    with int8_matmul.only_cpu_paths([] if path == "float" else [path]):
        return int8_linear(x, weight, w_scale, input_scale, packed)


def signed_codes(shape: tuple[int, ...], low: int, high: int, g: torch.Generator) -> torch.Tensor:
    """Codes in ``[low, high)`` with random signs: never zero."""
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    return torch.randint(low, high, shape, generator=g) * sign


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cols", [EXACT_FLOAT32, 1537])
def test_int8_linear_is_exact_integer_accumulation(path: str, cols: int) -> None:
    g = torch.Generator().manual_seed(1)
    # large codes of one sign: the wide sums pass 2**24, where float32 accumulation would round
    weight = torch.randint(100, 128, (6, cols), generator=g).to(torch.int8)
    weight[0] = -128
    x = torch.randint(100, 128, (3, cols), generator=g).float()
    x[:, 0] = 127.0  # each row's scale is exactly 1: its codes are x itself
    w_scale = torch.rand(6, 1, generator=g) + 0.5
    acc = x.double() @ weight.double().T  # float64: exact below 2**53
    want = acc.float() * w_scale.reshape(1, -1)  # int32 accumulation, then float32 scaling (x's scale is 1)
    assert torch.equal(run(path, x, weight, w_scale), want)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [1, 32, 256, 600])  # 600: blocks of ROW_BLOCK rows
@pytest.mark.parametrize(("out", "cols"), SHAPES)
def test_every_cpu_product_gives_the_float64_sums_at_the_default_models_shapes(
    path: str, rows: int, out: int, cols: int,
) -> None:
    g = torch.Generator().manual_seed(out + cols + rows)
    weight = signed_codes((out, cols), 1, 129, g).clamp(-128, 127).to(torch.int8)
    x = signed_codes((rows, cols), 1, 128, g).float()
    x[:, 0] = 127.0  # scale 1 per row: the codes are x
    w_scale = torch.rand(out, 1, generator=g, dtype=torch.float64) + 0.25
    got = run(path, x, weight, w_scale.float())
    acc = x.double() @ weight.double().T
    assert torch.equal(got, acc.float() * w_scale.float().reshape(1, -1))
    want = acc * w_scale.reshape(1, -1)  # the float64 product of codes and scales
    assert ((got.double() - want).abs() / want.abs().clamp_min(1e-30)).max() < 2e-7


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("static", [False, True])
def test_scaled_product_matches_float64_on_dequantized_values(path: str, static: bool) -> None:
    """Random float activations, a per-tensor weight scale: the output is the float64 product of the
    dequantized weight and the activations rounded to their int8 grid (per token, or the static scale)."""
    g = torch.Generator().manual_seed(7)
    weight = signed_codes((640, 576), 1, 128, g).to(torch.int8)
    x = torch.randn(5, 576, generator=g) * 3
    w_scale = torch.tensor([[0.0123]])
    input_scale = torch.tensor(0.021) if static else None
    s = torch.full((5, 1), 0.021, dtype=torch.float64) if static else x.double().abs().amax(1, keepdim=True) / 127
    x_q = torch.round(x.double() / s).clamp(-127, 127) * s
    want = x_q @ (weight.double() * 0.0123).T
    got = run(path, x, weight, w_scale, input_scale)
    assert ((got.double() - want).abs().max() / want.abs().max()) < 1e-6


def test_merged_shards_equal_the_shards_one_by_one() -> None:
    g = torch.Generator().manual_seed(3)
    shards = [(signed_codes((n, 576), 1, 128, g).to(torch.int8), scale, None)
              for n, scale in ((576, torch.rand(576, 1, generator=g) + 0.1), (192, torch.tensor([[0.5]])), (192, torch.tensor(0.25)))]
    x = torch.randn(9, 576, generator=g)
    merged = merge(shards)
    assert merged is not None and merged.weight.shape == (960, 576)
    one_by_one = torch.cat([int8_linear(x, w, s, None) for w, s, _ in shards], dim=-1)
    assert torch.equal(merged(x), one_by_one)
    static = [(w, s, torch.tensor(0.02 * (i + 1))) for i, (w, s, _) in enumerate(shards)]
    assert merge(static) is None  # different static scales: the activations are quantized per shard


def test_prepack_leaves_small_weights_to_int_mm() -> None:
    small = torch.ones(64, 64, dtype=torch.int8)
    assert int8_matmul.prepack(small, torch.ones(1)) is None
    large = torch.ones(576, 576, dtype=torch.int8)
    assert (int8_matmul.prepack(large, torch.ones(1)) is not None) == ("onednn" in int8_matmul.cpu_int8_paths())


def test_only_cpu_paths_restores_the_probed_paths_and_refuses_unknown_ones() -> None:
    found = list(int8_matmul.cpu_int8_paths())
    with pytest.raises(RuntimeError, match="inside"):
        with int8_matmul.only_cpu_paths([]):
            assert int8_matmul.cpu_int8_paths() == []
            raise RuntimeError("inside")
    assert int8_matmul.cpu_int8_paths() == found
    with pytest.raises(ValueError, match=r"\['vnni-by-hand'\] are not exact on this CPU"):
        with int8_matmul.only_cpu_paths(["vnni-by-hand"]):
            pass
    assert int8_matmul.cpu_int8_paths() == found


@pytest.mark.parametrize(("flags", "onednn"), [
    ({"avx512_vnni", "avx512f"}, False),  # AMD Zen 4, Intel before Sapphire Rapids: oneDNN's reference kernel
    ({"avx512_vnni", "amx_int8", "amx_tile"}, True),
    ({"avx2"}, False),  # no exact integer dot product: the float path
], ids=["vnni", "amx", "neither"])
def test_onednn_int8_only_where_amx_multiplies_it(monkeypatch: pytest.MonkeyPatch, flags: set[str], onednn: bool) -> None:
    """Without AMX-INT8 oneDNN has no native s8 x s8 kernel and runs its reference one (2.4 s for a one-token
    step of the default model on an AMD EPYC): W8A8 must not send its products there."""
    if onednn and not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")):
        pytest.skip("torch without oneDNN's int8 linear")
    monkeypatch.setattr(int8_matmul.host, "cpu_flags", lambda: frozenset(flags))
    found = int8_matmul._probe()
    assert ("onednn" in found) == onednn, found
    if flags & set(int8_matmul.INTEGER_DOT_FLAGS) and hasattr(torch, "_int_mm"):
        assert "int_mm" in found, found  # exact wherever torch has it: the VNNI-only CPUs' product
    else:
        assert found == []
