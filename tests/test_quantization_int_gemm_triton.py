"""The Triton GEMM of group-wise integer weights (CUDA's W4A16 / W8A16 product), run in Triton's interpreter off
CUDA: against float64 dequantize-then-matmul for 4- and 8-bit codes, groups of 32 and 128 and one per row, sizes off
every block, float32 / float16 / bfloat16 activations, a poisoned output's column slice; the packing against its
definition; a tensor-parallel rank's slice of GPTQ's groups; a merged GPTQ layer (and one in activation order), an AWQ
and a compressed-tensors W8A16 one through the built-in methods with the Triton path forced on this device (above
``INT_GEMM_MAX_TOKENS`` rows, the decoded path); ``out`` refused where it cannot be written.  On a CUDA host every
test runs there, compiled (the GPU script runs this file)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is decorated (a CUDA host compiles it)
int_gemm_triton = pytest.importorskip("corerun.quantization.int_gemm_triton")

from corerun.conformance.reference.quantizers import FORMATS  # noqa: E402
from corerun.quantization.quantized_tensor import Codes  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# normwise against float64 over the inputs rounded to the dtype: float32's ieee products, half precision's rounding of
# the decoded weight and of the output (each about 2^-11 / 2^-9 relative RMS in float16 / bfloat16, measured 3.1e-4 and,
# in the interpreter, whose conversion to bfloat16 truncates, 6.2e-3); on a device bfloat16 rounds to nearest
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1.2e-2 if int_gemm_triton.INTERPRET else 4e-3}


def codes(rows: int, cols: int, group: int, bits: int, seed: int) -> tuple[Codes, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = -(-cols // group)
    top = 2**bits
    q = torch.randint(0, top, (rows, cols), generator=g, dtype=torch.int32)
    z = torch.randint(0, top, (rows, n), generator=g, dtype=torch.int32)
    s = (torch.rand(rows, n, generator=g) * 0.02 + 1e-3).half().float()
    groups = torch.arange(cols) // group
    return Codes(q, z, s, groups), (q - z[:, groups]).double() * s[:, groups].double()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows,cols,group,tokens", [(40, 96, 32, 1), (70, 256, 128, 5), (33, 100, 100, 17), (64, 200, 32, 3)])
def test_int_gemm_matches_float64(bits: int, rows: int, cols: int, group: int, tokens: int) -> None:
    c, w = codes(rows, cols, group, bits, rows + cols + bits)
    packed = int_gemm_triton.pack(c, bits)
    assert packed is not None and packed.group == group and packed.perm is None
    packed = int_gemm_triton.PackedInt(packed.words.to(DEVICE), packed.scales.to(DEVICE), packed.negzs.to(DEVICE), bits, group, cols, None)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens), dtype=torch.float64)
    for dtype, tol in TOLERANCE.items():
        xr = x.to(dtype)
        want = xr.double() @ w.T
        wide = torch.full((tokens, rows + 2), float("nan"), dtype=dtype, device=DEVICE)  # poisoned; columns 1 .. rows written
        got = int_gemm_triton.int_gemm(xr.to(DEVICE), packed, wide[:, 1 : rows + 1]).cpu()
        assert got.dtype == dtype
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < tol, f"{dtype}: normwise error {err:.2e} (tolerance {tol:.0e})"
        assert torch.isnan(wide[:, 0].float()).all() and torch.isnan(wide[:, rows + 1].float()).all()


def test_packing_is_its_definition() -> None:
    c, _ = codes(3, 20, 8, 4, 1)  # 20 columns: the last word holds 4 codes and 4 zero paddings
    p = int_gemm_triton.pack(c, 4)
    assert p.words.shape == (3, 3) and p.scales.shape == p.negzs.shape == (3, 3)
    for n in range(3):
        for k in range(20):
            assert (int(p.words[n, k // 8]) >> (4 * (k % 8))) & 15 == c.q[n, k]
        assert torch.equal(p.negzs[n], -(c.scales[n] * c.zeros[n].float()))


def test_activation_order_is_sorted_and_uneven_groups_refused() -> None:
    c, w = codes(16, 64, 32, 4, 2)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    shuffled = Codes(c.q[:, perm], c.zeros, c.scales, c.groups[perm])  # the same weight, columns in another order
    p = int_gemm_triton.pack(shuffled, 4)
    assert p is not None and p.perm is not None and p.group == 32
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    p = _on_device(p)
    got = int_gemm_triton.int_gemm(x[:, perm].contiguous().to(DEVICE), p).cpu()
    want = x[:, perm].double() @ w[:, perm].T
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-5
    assert int_gemm_triton.pack(Codes(c.q, c.zeros, c.scales, torch.cat([torch.zeros(20), torch.ones(44)]).long()), 4) is None


def _on_device(p):
    from dataclasses import replace

    return replace(p, words=p.words.to(DEVICE), scales=p.scales.to(DEVICE), negzs=p.negzs.to(DEVICE),
                   perm=None if p.perm is None else p.perm.to(DEVICE))


def test_a_row_parallel_slice_of_gptq_groups_packs_from_its_first_group() -> None:
    """A tensor-parallel rank's input slice of GPTQ keeps the model's group numbers (``g_idx`` 2, 3 on rank 1 of 2) and
    the whole scales: the packing keeps the groups it uses."""
    c, w = codes(24, 128, 32, 4, 5)
    half = Codes(c.q[:, 64:], c.zeros, c.scales, c.groups[64:])  # groups 2 and 3
    p = int_gemm_triton.pack(half, 4)
    assert p is not None and p.scales.shape == (24, 2) and torch.equal(p.scales, c.scales[:, 2:4])
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6))
    got = int_gemm_triton.int_gemm(x.to(DEVICE), _on_device(p)).cpu()
    want = x.double() @ w[:, 64:].T
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-5


def test_int_gemm_refuses_an_out_it_cannot_write() -> None:
    c, _ = codes(8, 64, 32, 4, 1)
    p = _on_device(int_gemm_triton.pack(c, 4))
    x = torch.randn(2, 64, device=DEVICE)
    for bad in (torch.empty(2, 9, device=DEVICE), torch.empty(2, 8, dtype=torch.float16, device=DEVICE),
                torch.empty(8, 2, device=DEVICE).t(), torch.empty(1, 8, device=DEVICE).expand(2, 8)):
        with pytest.raises(ValueError, match="out must be"):
            int_gemm_triton.int_gemm(x, p, bad)


@pytest.mark.parametrize("fmt,rows_per_shard,one_launch", [("gptq-4bit-g32", 32, True), ("gptq-4bit-g32-act-order", 32, False),
                                                            ("ct-w8a16-pack-channel", 24, True), ("awq-4bit-g32", 32, True)])
def test_a_merged_layer_multiplies_in_the_triton_gemm(monkeypatch: pytest.MonkeyPatch, fmt: str, rows_per_shard: int, one_launch: bool) -> None:
    from corerun.models.layers import MergedLinear
    from corerun.quantization import packed_method
    from corerun.quantization.packed_method import AWQMethod, CompressedTensorsMethod, GPTQMethod

    monkeypatch.setattr(packed_method, "triton_int_gemm", lambda device: True)  # as on CUDA
    ref0 = FORMATS[fmt].make(rows_per_shard, 96, 0)
    method = {"gptq": GPTQMethod, "awq": AWQMethod, "compressed-tensors": CompressedTensorsMethod}[FORMATS[fmt].quant_method]()
    sizes = {"q": rows_per_shard, "k": rows_per_shard, "v": rows_per_shard}
    layer = MergedLinear(96, sizes, quant=method).to(DEVICE)
    weights = []
    for i, shard in enumerate(sizes):
        ref = ref0 if i == 0 else FORMATS[fmt].make(rows_per_shard, 96, i)
        loaded = list(method.checkpoint_weights((("m.q_proj." + k, t) for k, t in ref.tensors.items()), ref.config))[0][1]
        layer.weight.weight_loader(layer.weight, loaded, shard)
        weights.append(ref.weight)
    assert layer.int_gemm is not None and len(layer.int_gemm) == (1 if one_launch else 3)
    calls = []
    real = int_gemm_triton.int_gemm
    monkeypatch.setattr(int_gemm_triton, "int_gemm", lambda *a: (calls.append(1), real(*a))[1])
    w = torch.cat(weights)
    for tokens in (3, packed_method.INT_GEMM_MAX_TOKENS + 1):  # a decode step, then a prefill: the decoded path
        x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            y = layer(x.to(DEVICE)).cpu()
        want = x.double() @ w.T
        assert ((y.double() - want).norm() / want.norm()).item() < 1e-5
    assert len(calls) == len(layer.int_gemm)  # the first call's launches only


def test_the_environment_keeps_the_decoded_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from corerun.quantization import packed_method

    monkeypatch.setenv(packed_method.INT_GEMM_ENV, "0")
    assert not packed_method.triton_int_gemm(torch.device("cuda"))
    assert not packed_method.triton_int_gemm(torch.device("cpu"))
