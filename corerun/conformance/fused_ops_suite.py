"""The fused-ops conformance suite: ``rms_norm``, ``add_rms_norm``, ``silu_and_mul`` and ``rotary`` against float64 closed forms.

Each case draws random inputs in float64 (never zeros), rounds them to the case's dtype and hands the
op views laid out as the model hands them; the reference is the closed form in float64 from the
rounded inputs (the inputs' rounding is not the op's error).  The output must be within a relative
Frobenius error (``||out - ref|| / ||ref||``) of :data:`BOUNDS` for the dtype, a new contiguous tensor
of the input's dtype, device and the op's shape, and every input must come back unchanged, bit for bit.

Checks, one case per declared dtype (float32, bfloat16, float16, float64) and layout:

- ``rms_norm``: ``rows``, ``x`` ``[T, H]`` for T 1, 7, 300 and H 576 and 100 (an odd size); ``heads``,
  the per-head view ``[T, Hq, D]`` of a ``[T, (Hq + 2 Hkv) D]`` qkv output (Qwen3's q norm), D 64 and
  128.  Rows span four orders of magnitude down to ``mean(x**2)`` below ``eps``, so ``eps`` counts;
- ``add_rms_norm`` (optional: an implementation without it is reported skipped): ``x`` and ``residual``
  ``[T, H]``, H 576 and 100, contiguous (``rows``) or both views of wider tensors (``strided``), rows of
  their sum scaled as ``rms_norm``'s; both outputs (``normed``, ``new_residual``) checked, the norm against
  the float64 norm of the unrounded sum;
- ``silu_and_mul``: ``x`` ``[T, 2I]``, a view of the rows of a wider tensor (strided rows), I 384 and 100;
- ``rotary``: the q and k views (``[T, Hq, D]`` and ``[T, Hkv, D]``, and both together) of a
  ``[T, (Hq + 2 Hkv) D]`` qkv output, D 64 and 128, T 1, 7 (below 64) and 300 (above), random angles.

Adopt it with::

    class TestMine(FusedOpsSuite):
        implementation = "mine"
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from corerun.conformance.suite import Case, ConformanceSuite
from corerun.conformance.target import Target
from corerun.conformance.tolerances import SHORT_DTYPE

DTYPES = ("float32", "bfloat16", "float16", "float64")
# dtype -> the largest relative Frobenius error against the float64 closed form (the ops compute in
# float32, float64 inputs included)
BOUNDS = {"float32": 1e-5, "bfloat16": 8e-3, "float16": 2e-3, "float64": 1e-5}
TOKENS = (1, 7, 300)  # one decode token, below and above 64 (where implementations often switch paths)
HQ, HKV = 4, 2  # query and KV heads of the qkv views


@dataclass(frozen=True)
class OpsCase:
    """One problem: ``tokens`` rows of the ``layout`` (``rows`` / ``heads`` / ``q`` / ``k`` / ``qk``), ``size``
    features (H for rows, I for silu_and_mul, D for per-head layouts)."""

    dtype: str
    layout: str
    tokens: int
    size: int


def _generator(case: OpsCase, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{case.layout}-{case.tokens}-{case.size}-{salt}".encode()))


def _rounded(values: torch.Tensor, case: OpsCase, device: str) -> torch.Tensor:
    return values.to(getattr(torch, case.dtype)).to(device)


def qkv_view(case: OpsCase, g: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[T, (HQ + 2 HKV) D]`` qkv output, and the view of it ``case.layout`` names (``[T, heads, D]``)."""
    d, t = case.size, case.tokens
    qkv = _rounded(torch.randn(t, (HQ + 2 * HKV) * d, generator=g, dtype=torch.float64), case, device)
    start, heads = {"q": (0, HQ), "heads": (0, HQ), "k": (HQ, HKV), "qk": (0, HQ + HKV)}[case.layout]
    return qkv, qkv[:, start * d : (start + heads) * d].view(t, heads, d)


def rms_inputs(case: OpsCase, device: str) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, float]:
    """``(tensors to keep unchanged, x, weight, eps)``; each row of ``x`` scaled by ``10**u``, u in [-3, 0.5)."""
    g = _generator(case, 1)
    if case.layout == "rows":
        base = _rounded(torch.randn(case.tokens, case.size, generator=g, dtype=torch.float64), case, device)
        x, width = base, case.size
    else:
        base, x = qkv_view(case, g, device)
        width = case.size
    scale = 10.0 ** (torch.rand(*x.shape[:-1], 1, generator=g, dtype=torch.float64) * 3.5 - 3.0)
    x.copy_((x.double().cpu() * scale).to(x.dtype))
    weight = _rounded(torch.rand(width, generator=g, dtype=torch.float64) * 1.5 + 0.25, case, device)
    return [base, weight], x, weight, 1e-5


def rms_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.detach().cpu().double()
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.detach().cpu().double()


def add_rms_inputs(case: OpsCase, device: str) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tensors to keep unchanged, x, residual, weight)``: ``[T, H]`` each (``strided``: the first H columns of
    ``[T, H + 40]`` tensors), both rows scaled by one ``10**u``, u in [-3, 0.5), so that ``eps`` counts."""
    g = _generator(case, 4)
    width = case.size + (40 if case.layout == "strided" else 0)
    scale = 10.0 ** (torch.rand(case.tokens, 1, generator=g, dtype=torch.float64) * 3.5 - 3.0)
    wide = [_rounded(torch.randn(case.tokens, width, generator=g, dtype=torch.float64) * scale, case, device)
            for _ in range(2)]
    weight = _rounded(torch.rand(case.size, generator=g, dtype=torch.float64) * 1.5 + 0.25, case, device)
    return [*wide, weight], wide[0][:, : case.size], wide[1][:, : case.size], weight


def silu_inputs(case: OpsCase, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(the wider tensor, x)``: ``x`` ``[T, 2I]`` its first ``2I`` columns (rows strided by ``2I + 24``)."""
    g = _generator(case, 2)
    wide = _rounded(torch.randn(case.tokens, 2 * case.size + 24, generator=g, dtype=torch.float64) * 2, case, device)
    return wide, wide[:, : 2 * case.size]


def silu_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.detach().cpu().double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def rotary_inputs(case: OpsCase, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(qkv, x, cos, sin)``: ``cos = [c | c]``, ``sin = [-s | s]`` float32 ``[T, 1, D]`` of random angles."""
    g = _generator(case, 3)
    qkv, x = qkv_view(case, g, device)
    angles = torch.rand(case.tokens, 1, case.size // 2, generator=g, dtype=torch.float64) * 2 * torch.pi
    c, s = angles.cos().float(), angles.sin().float()
    return qkv, x, torch.cat([c, c], -1).to(device), torch.cat([-s, s], -1).to(device)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x64 = x.detach().cpu().double()
    c, s = cos.cpu().double()[..., :half], sin.cpu().double()[..., half:]
    x1, x2 = x64[..., :half], x64[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def check_output(what: str, dtype: str, out: Any, ref: torch.Tensor, like: torch.Tensor,
                 inputs: list[torch.Tensor], before: list[torch.Tensor]) -> None:
    """``out`` a new contiguous tensor of ``like``'s dtype and device and ``ref``'s shape, within the dtype's
    bound of ``ref``; ``inputs`` unchanged (compared with ``before``, their copies)."""
    for i, (now, then) in enumerate(zip(inputs, before)):
        if not torch.equal(now, then):
            changed = int((now != then).sum())
            raise AssertionError(f"{what}: input {i} changed ({changed} of {now.numel()} elements): "
                                 "every op must return a new tensor and leave its inputs unchanged")
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"{what}: returned {type(out).__name__}, not a tensor")
    shape = tuple(ref.shape)
    if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device:
        raise AssertionError(f"{what}: returned {tuple(out.shape)} {out.dtype} on {out.device}; expected "
                             f"{shape} {like.dtype} on {like.device}")
    if not out.is_contiguous():
        raise AssertionError(f"{what}: the output is not contiguous (strides {out.stride()})")
    if any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in inputs):
        raise AssertionError(f"{what}: the output shares memory with an input; it must be a new tensor")
    got = out.detach().cpu().double()
    if not torch.isfinite(got).all():
        raise AssertionError(f"{what}: {int((~torch.isfinite(got)).sum())} of {got.numel()} outputs are NaN or infinite")
    err = float((got - ref).norm() / ref.norm())
    if err > BOUNDS[dtype]:
        worst = int((got - ref).abs().argmax())
        raise AssertionError(f"{what}: relative (Frobenius) error {err:.3g} against the float64 closed form, "
                             f"bound {BOUNDS[dtype]:g} for {dtype}; worst at flat index {worst}: got "
                             f"{got.flatten()[worst].item():.6g}, expected {ref.flatten()[worst].item():.6g}")


def run_op(what: str, case: OpsCase, op: Callable[..., Any], args: tuple, inputs: list[torch.Tensor],
           ref: torch.Tensor) -> None:
    before = [t.clone() for t in inputs]
    out = op(*args)
    check_output(what, case.dtype, out, ref, args[0], inputs, before)


def run_add_rms_norm(what: str, case: OpsCase, op: Callable[..., Any], x: torch.Tensor, residual: torch.Tensor,
                     weight: torch.Tensor, kept: list[torch.Tensor], eps: float = 1e-5) -> None:
    """``op(x, residual, weight, eps)`` returns ``(normed, new_residual)``, two new tensors, each checked as
    :func:`check_output` checks one: ``x + residual`` and its norm, both in float64 from the rounded inputs."""
    before = [t.clone() for t in kept]
    got = op(x, residual, weight, eps)
    if not isinstance(got, tuple) or len(got) != 2:
        raise AssertionError(f"{what}: returned {type(got).__name__}, not the pair (normed, new_residual)")
    total = x.detach().cpu().double() + residual.detach().cpu().double()
    check_output(f"{what} (new_residual)", case.dtype, got[1], total, x, kept, before)
    check_output(f"{what} (normed)", case.dtype, got[0], rms_reference(total, weight, eps), x, kept, before)
    if got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr():
        raise AssertionError(f"{what}: normed and new_residual share memory; each must be a new tensor")


class FusedOpsSuite(ConformanceSuite):
    """The fused-ops conformance suite (see the module docstring)."""

    kind = "fused_ops"

    def configs(self, check: str, target: Target, full: bool) -> list[tuple[str, Any]] | str:
        dtypes = [d for d in DTYPES if d in target.capabilities.dtypes]
        if not dtypes:
            return f"{target.label} declares none of the dtypes {', '.join(DTYPES)}"
        if check == "rms_norm":
            shapes = [("rows", f"h{h}", h) for h in (576, 100)] + [("heads", f"d{d}", d) for d in (64, 128)]
        elif check == "add_rms_norm":
            factory = target.implementation_class()
            if isinstance(factory, type) and not callable(getattr(factory, "add_rms_norm", None)):
                return f"{target.label} has no add_rms_norm (optional: the layers add the residual in torch)"
            shapes = [(layout, f"h{h}", h) for layout in ("rows", "strided") for h in (576, 100)]
        elif check == "silu_and_mul":
            shapes = [("rows", f"i{i}", i) for i in (384, 100)]
        else:
            shapes = [(layout, f"d{d}", d) for layout in ("qk", "q", "k") for d in (64, 128)]
        return [(f"{SHORT_DTYPE[d]}-{layout}-t{t}-{size_id}", OpsCase(d, layout, t, size))
                for d in dtypes for layout, size_id, size in shapes for t in TOKENS]

    def _ops(self, case: Case) -> Any:
        self.start(case)
        return case.target.create()

    def test_rms_norm(self, case: Case) -> None:
        ops = self._ops(case)
        kept, x, weight, eps = rms_inputs(case.config, case.device)
        run_op(f"{case.id}: rms_norm", case.config, ops.rms_norm, (x, weight, eps), kept, rms_reference(x, weight, eps))

    def test_add_rms_norm(self, case: Case) -> None:
        ops = self._ops(case)
        if not callable(getattr(ops, "add_rms_norm", None)):
            import pytest

            pytest.skip(f"{case.target.label} has no add_rms_norm (optional: the layers add the residual in torch)")
        kept, x, residual, weight = add_rms_inputs(case.config, case.device)
        run_add_rms_norm(f"{case.id}: add_rms_norm", case.config, ops.add_rms_norm, x, residual, weight, kept)

    def test_silu_and_mul(self, case: Case) -> None:
        ops = self._ops(case)
        wide, x = silu_inputs(case.config, case.device)
        run_op(f"{case.id}: silu_and_mul", case.config, ops.silu_and_mul, (x,), [wide], silu_reference(x))

    def test_rotary(self, case: Case) -> None:
        ops = self._ops(case)
        qkv, x, cos, sin = rotary_inputs(case.config, case.device)
        run_op(f"{case.id}: rotary", case.config, ops.rotary, (x, cos, sin), [qkv, cos, sin],
               rotary_reference(x, cos, sin))
