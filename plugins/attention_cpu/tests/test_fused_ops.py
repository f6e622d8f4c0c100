"""The ``cpu`` fused ops (csrc/fused_ops.cpp) against float64 closed forms, on random inputs read through
strided views of a fused qkv / gate_up output: float32 within 1e-5, bfloat16 within 8e-3 relative error
(Frobenius, and the largest error against the largest value); inputs unchanged; every output element
written (the output is allocated poisoned with NaN) into a new contiguous tensor."""

from __future__ import annotations

import pytest
import torch

from corerun_attention_cpu.fused_ops import CpuFusedOps
from cpu_attn_cases import needs_compiler

pytestmark = needs_compiler

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
TOKENS = pytest.mark.parametrize("tokens", [1, 7, 300])


@pytest.fixture(scope="module")
def ops() -> CpuFusedOps:
    return CpuFusedOps()


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch):
    """``torch.empty`` and ``empty_like`` hand out NaN-filled tensors: an element the kernel leaves unwritten fails."""
    for name in ("empty", "empty_like"):
        make = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, make=make, **k: make(*a, **k).fill_(float("nan")))


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = out.double() - ref
    frob = (err.norm() / ref.norm()).item()
    worst = (err.abs().max() / ref.abs().max()).item()
    tol = TOLERANCE[dtype]
    assert frob <= tol and worst <= tol, f"relative error {frob:.3g} (largest {worst:.3g}), tolerance {tol:g}"


def _check_new(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, *inputs: torch.Tensor) -> None:
    assert out.shape == shape and out.dtype == dtype and out.is_contiguous()
    assert all(out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in inputs)


def _random(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd / (xd.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w.double()


@DTYPES
@TOKENS
@pytest.mark.parametrize("hidden", [576, 100])
def test_rms_norm_of_rows_of_a_wider_tensor(ops, dtype, tokens, hidden):
    gen = torch.Generator().manual_seed(tokens * 1000 + hidden)
    wide = _random(gen, tokens, 3 * hidden, dtype=dtype, scale=3.0)
    x = wide[:, hidden : 2 * hidden]  # rows strided by 3H
    w = _random(gen, hidden, dtype=dtype)
    before = wide.clone(), w.clone()
    out = ops.rms_norm(x, w, 1e-5)
    _close(out, _rms_ref(x, w, 1e-5), dtype)
    _check_new(out, (tokens, hidden), dtype, wide, w)
    assert torch.equal(wide, before[0]) and torch.equal(w, before[1])
    _close(ops.rms_norm(x.contiguous(), w, 1e-5), _rms_ref(x, w, 1e-5), dtype)


@DTYPES
@TOKENS
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rms_norm_per_head_of_a_fused_qkv(ops, dtype, tokens, head_dim):
    """A q/k norm: [T, H, D] heads of a [T, (9 + 3 + 3) * D] qkv output, two strided leading dimensions."""
    gen = torch.Generator().manual_seed(tokens + head_dim)
    qkv = _random(gen, tokens, 15 * head_dim, dtype=dtype, scale=0.01)  # eps 1e-5 is 10% of mean(x**2)
    k = qkv[:, 9 * head_dim : 12 * head_dim].view(tokens, 3, head_dim)
    w = _random(gen, head_dim, dtype=dtype)
    before = qkv.clone()
    out = ops.rms_norm(k, w, 1e-5)
    _close(out, _rms_ref(k, w, 1e-5), dtype)
    _check_new(out, (tokens, 3, head_dim), dtype, qkv)
    assert torch.equal(qkv, before)
    heads_first = _random(gen, 3, tokens, head_dim, dtype=dtype).transpose(0, 1)  # heads strided past the tokens
    _close(ops.rms_norm(heads_first, w, 1e-6), _rms_ref(heads_first, w, 1e-6), dtype)


def test_rms_norm_merges_leading_dimensions_and_refuses_three_strided_ones(ops):
    gen = torch.Generator().manual_seed(5)
    x = _random(gen, 2, 3, 4, 32, dtype=torch.float32)
    w = _random(gen, 32, dtype=torch.float32)
    _close(ops.rms_norm(x, w, 1e-5), _rms_ref(x, w, 1e-5), torch.float32)  # contiguous: one row dimension
    _close(ops.rms_norm(x[:, 1:], w, 1e-5), _rms_ref(x[:, 1:], w, 1e-5), torch.float32)  # two strided ones
    with pytest.raises(ValueError, match="at most two strided leading dimensions"):
        ops.rms_norm(x[:, 1:, 1:], w, 1e-5)


@DTYPES
@TOKENS
@pytest.mark.parametrize("hidden", [576, 100])
def test_add_rms_norm_of_rows_of_wider_tensors(ops, dtype, tokens, hidden):
    """``(rms_norm(x + residual), x + residual)``: the sum rounded once (equal to torch's add of the two),
    the norm from that rounded sum (as the add and ``rms_norm`` one after the other), against float64."""
    gen = torch.Generator().manual_seed(tokens * 31 + hidden)
    wide_x = _random(gen, tokens, hidden + 24, dtype=dtype, scale=3.0)
    wide_r = _random(gen, tokens, 2 * hidden, dtype=dtype, scale=3.0)
    x, residual = wide_x[:, 24:], wide_r[:, hidden:]  # rows strided differently
    w = _random(gen, hidden, dtype=dtype)
    before = wide_x.clone(), wide_r.clone(), w.clone()
    normed, new_residual = ops.add_rms_norm(x, residual, w, 1e-5)
    total = x.double() + residual.double()
    _close(new_residual, total, dtype)
    assert torch.equal(new_residual, x + residual)  # float32 sum rounded once: torch's own add, bit for bit
    _close(normed, _rms_ref(total, w, 1e-5), dtype)
    _close(normed, _rms_ref(new_residual, w, 1e-5), dtype)
    for out in (normed, new_residual):
        _check_new(out, (tokens, hidden), dtype, wide_x, wide_r, w)
    assert normed.untyped_storage().data_ptr() != new_residual.untyped_storage().data_ptr()
    assert all(torch.equal(a, b) for a, b in zip((wide_x, wide_r, w), before))


def test_add_rms_norm_refuses_mismatched_inputs(ops):
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="add_rms_norm takes x and residual"):
        ops.add_rms_norm(x, torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(64), 1e-5)
    with pytest.raises(ValueError, match="add_rms_norm takes x and residual"):
        ops.add_rms_norm(x, torch.randn(4, 128)[:, ::2], torch.randn(64), 1e-5)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ops.add_rms_norm(x.half(), x.half(), torch.randn(64).half(), 1e-5)


@DTYPES
@TOKENS
@pytest.mark.parametrize("inter", [1536, 100])
def test_silu_and_mul_of_a_strided_gate_up(ops, dtype, tokens, inter):
    gen = torch.Generator().manual_seed(tokens * 7 + inter)
    padded = _random(gen, tokens, 2 * inter + 48, dtype=dtype, scale=4.0)  # reaches far into both tails of silu
    x = padded[:, : 2 * inter]
    before = padded.clone()
    out = ops.silu_and_mul(x)
    gate, up = x.double().chunk(2, dim=-1)
    _close(out, gate / (1 + torch.exp(-gate)) * up, dtype)
    _check_new(out, (tokens, inter), dtype, padded)
    assert torch.equal(padded, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_silu_and_mul_at_extreme_gates(ops, dtype):
    """Gates far into both tails, where e^-|g| leaves the normal floats or underflows to 0, and inf / NaN:
    each output against the float64 closed form (relative error, and 1e-37 absolute for the denormals)."""
    gen = torch.Generator().manual_seed(11)
    tails = [-1e30, -200.0, -104.0, -100.0, -90.0, -87.5, -87.0, -20.0, -0.0, 0.0, 88.0, 100.0, 1e30]
    gate = torch.tensor(tails * 3 + [float("inf"), float("-inf"), float("nan")], dtype=torch.float64)
    up = torch.rand(gate.shape[0], generator=gen, dtype=torch.float64) + 0.5
    x = torch.cat([gate, up]).to(dtype).view(1, -1)
    out = ops.silu_and_mul(x)[0].double()
    g, u = x[0].double().chunk(2)
    ref = g / (1 + torch.exp(-g)) * u  # -inf gives NaN, as in torch's silu
    assert torch.equal(out.isnan(), ref.isnan())
    ok = (out == ref) | ((out - ref).abs() <= TOLERANCE[dtype] * ref.abs() + 1e-37)
    assert ok[~ref.isnan()].all(), f"gates {g[~ok].tolist()}: {out[~ok].tolist()} against {ref[~ok].tolist()}"


def _angles(gen: torch.Generator, tokens: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos = [c | c], sin = [-s | s] float32 [T, 1, D] for random positions and frequencies."""
    theta = torch.rand(tokens, 1, dim // 2, generator=gen, dtype=torch.float64) * 200
    c, s = theta.cos(), theta.sin()
    return torch.cat([c, c], -1).float(), torch.cat([-s, s], -1).float()


def _rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x.double()[..., :half], x.double()[..., half:]
    c, s = cos.double()[..., :half], sin.double()[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


@DTYPES
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # 80: halves of 40, not a multiple of 32
def test_rotary_of_q_and_k_views_of_a_fused_qkv(ops, dtype, tokens, head_dim):
    gen = torch.Generator().manual_seed(tokens * 3 + head_dim)
    qkv = _random(gen, tokens, 15 * head_dim, dtype=dtype)
    q = qkv[:, : 9 * head_dim].view(tokens, 9, head_dim)
    k = qkv[:, 9 * head_dim : 12 * head_dim].view(tokens, 3, head_dim)
    cos, sin = _angles(gen, tokens, head_dim)
    before = qkv.clone(), cos.clone(), sin.clone()
    for x, heads in ((q, 9), (k, 3)):
        out = ops.rotary(x, cos, sin)
        _close(out, _rotary_ref(x, cos, sin), dtype)
        _check_new(out, (tokens, heads, head_dim), dtype, qkv, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip((qkv, cos, sin), before))
    heads_first = _random(gen, 4, tokens, head_dim, dtype=dtype).transpose(0, 1)
    _close(ops.rotary(heads_first, cos, sin), _rotary_ref(heads_first, cos, sin), dtype)


def test_bfloat16_results_are_rounded_to_nearest_even_and_nan_stays_nan(ops):
    """Rounded once from float32: nearly every element equals the float64 result rounded to bfloat16
    (truncation would miss about half); a NaN input gives NaN where it is used."""
    gen = torch.Generator().manual_seed(9)
    x = _random(gen, 64, 9, 128, dtype=torch.bfloat16)
    cos, sin = _angles(gen, 64, 128)
    out = ops.rotary(x, cos, sin)
    assert (out == _rotary_ref(x, cos, sin).to(torch.bfloat16)).float().mean() > 0.99
    x[3, 2, 5] = float("nan")
    out = ops.rotary(x, cos, sin)
    assert out[3, 2, 5].isnan() and out[3, 2, 69].isnan() and out.isnan().sum() == 2


def test_bfloat16_rounding_keeps_denormals_as_torchs_add_does(ops):
    """The sum of ``add_rms_norm`` equals torch's add bit for bit where it is a float32 denormal (the kernel's
    vcvtne2ps2bf16 would flush those to 0: rows of 32 values holding one take the integer rounding), in rows of
    normal sums (the instruction's path), and around NaN and inf."""
    gen = torch.Generator().manual_seed(12)
    scale = torch.where(torch.arange(48) % 3 == 0, 1.0, 1e-38).view(48, 1)  # every third row normal
    x = (_random(gen, 48, 100, dtype=torch.float64) * scale).to(torch.bfloat16)
    residual = (_random(gen, 48, 100, dtype=torch.float64) * scale).to(torch.bfloat16)
    x[1, 40], x[2, 99], residual[4, 0], residual[7, 3] = float("nan"), float("inf"), float("-inf"), 1.0
    _, new_residual = ops.add_rms_norm(x, residual, _random(gen, 100, dtype=torch.bfloat16), 1e-5)
    expected = x + residual
    assert (expected.float().abs() < torch.finfo(torch.float32).tiny).sum() > 1000  # denormals present
    nan = expected.isnan()
    assert torch.equal(new_residual.isnan(), nan)
    assert torch.equal(new_residual.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])


def test_parallel_rows_match_one_thread(ops):
    gen = torch.Generator().manual_seed(4)
    x = _random(gen, 512, 2 * 1536, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.silu_and_mul(x)
        torch.set_num_threads(2)
        assert torch.equal(ops.silu_and_mul(x), one)
    finally:
        torch.set_num_threads(threads)


def test_what_the_kernels_do_not_take_is_refused(ops):
    x16 = torch.randn(4, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16.*float16.*fused_ops: torch"):
        ops.silu_and_mul(x16)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        ops.rms_norm(x[:, ::2], torch.randn(32), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, torch.randn(64, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match=r"cos and sin as contiguous float32 \[T, 1, D\]"):
        ops.rotary(x.view(4, 1, 64), torch.randn(4, 64), torch.randn(4, 1, 64))


def test_registered_as_cpu_and_picked_by_auto_where_it_fits():
    from corerun.protocols.fused_ops import FusedAddRMSNorm, FusedOps, FusedOpsNeed
    from corerun.sdk import get_registry

    reg = get_registry()
    cpu = reg.registrations["fused_ops"]["cpu"]
    assert cpu.distribution == "corerun-attention-cpu" and cpu.priority_on("cpu") > 0 > cpu.priority_on("cuda")
    assert reg.select("fused_ops", "auto", FusedOpsNeed("cpu", "bfloat16")).name == "cpu"
    assert reg.select("fused_ops", "auto", FusedOpsNeed("cpu", "float16")).name == "torch"  # not declared
    assert reg.select("fused_ops", "auto", FusedOpsNeed("cuda", "float32")).name != "cpu"
    assert isinstance(cpu.create(), FusedOps) and isinstance(cpu.create(), FusedAddRMSNorm)
