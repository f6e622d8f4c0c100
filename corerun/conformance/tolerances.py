"""Numerical tolerances of the conformance suite, per dtype, against a float64 reference.

Two measures per request (``err = out - ref``):

- ``rms``: ``||err||_2 / ||ref||_2``, the typical relative error;
- ``max``: ``max|err| / max|ref|``, the worst element relative to the output's scale.

float32 must be far under 1e-4; float16 / bfloat16 under a few 1e-3 (bfloat16 keeps 8 mantissa bits,
so rounding the output alone costs up to 2e-3 of an element).
"""

from __future__ import annotations

import torch

# dtype name -> (rms tolerance, max tolerance)
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-10, 1e-9),
    "float32": (2e-6, 2e-5),
    "float16": (1.5e-3, 5e-3),
    "bfloat16": (4e-3, 1e-2),
}

SHORT_DTYPE: dict[str, str] = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}


def relative_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """``(rms, max)`` relative errors of ``out`` against ``ref`` (both converted to float64)."""
    o, r = out.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    if not torch.isfinite(o).all():
        return float("inf"), float("inf")
    err = o - r
    scale_rms = r.norm().item() or 1.0
    scale_max = r.abs().max().item() or 1.0
    return err.norm().item() / scale_rms, err.abs().max().item() / scale_max


def within(dtype_name: str, out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, str]:
    """Whether ``out`` is within the dtype's tolerances of ``ref``, and a sentence saying by how much."""
    tol_rms, tol_max = TOLERANCES[dtype_name]
    rms, mx = relative_errors(out, ref)
    if rms != rms or rms == float("inf"):
        bad = (~torch.isfinite(out.detach().cpu())).sum().item()
        return False, f"{bad} of {out.numel()} elements are NaN or infinite (never written, or overflowed)"
    ok = rms <= tol_rms and mx <= tol_max
    return ok, f"relative error rms {rms:.3g} (tolerance {tol_rms:g}), max {mx:.3g} (tolerance {tol_max:g}) for {dtype_name}"
