"""How far a result is from its reference: one normwise relative error for every numeric test.

    assert_rel_err(out, reference_float64, 1e-5, what="attention output")
"""

from __future__ import annotations

import torch


def max_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |got - ref| / max |ref|``, both taken to float64 on the CPU (normwise: entries near zero
    do not dominate).  ``inf`` when ``got`` holds a NaN or an infinity.

    Raises ``ValueError`` when the shapes differ (no broadcasting), or when ``ref`` is all zeros or
    not finite (no scale to be relative to).
    """
    if tuple(got.shape) != tuple(ref.shape):
        raise ValueError(f"got has shape {tuple(got.shape)}, the reference {tuple(ref.shape)}: they must be equal")
    g = got.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    if not torch.isfinite(r).all():
        bad = int((~torch.isfinite(r)).sum())
        raise ValueError(f"the reference has {bad} NaN or infinite entries of {r.numel()}: it must be finite")
    scale = r.abs().max().item() if r.numel() else 0.0
    if scale == 0.0:
        raise ValueError(f"the reference (shape {tuple(r.shape)}) is all zeros: a relative error needs a nonzero scale")
    if not torch.isfinite(g).all():
        return float("inf")
    return (g - r).abs().max().item() / scale


def assert_rel_err(got: torch.Tensor, ref: torch.Tensor, bound: float, *, what: str = "result") -> float:
    """Assert :func:`max_rel_err` ``(got, ref) <= bound`` and return it.  ``ref`` should be computed in
    float64 (it is converted to float64 either way).  The ``AssertionError`` names ``what``, the error,
    the bound and where the largest difference is (or how many entries are NaN or infinite)."""
    err = max_rel_err(got, ref)
    if err <= bound:
        return err
    g = got.detach().to("cpu", torch.float64)
    if err == float("inf"):
        bad = int((~torch.isfinite(g)).sum())
        raise AssertionError(f"{what}: {bad} of {g.numel()} entries are NaN or infinite; relative error bound {bound:g}")
    diff = (g - ref.detach().to("cpu", torch.float64)).abs()
    flat = int(diff.reshape(-1).argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)) if diff.dim() else ()
    raise AssertionError(
        f"{what}: max relative error {err:.3g} exceeds the bound {bound:g} "
        f"(largest difference at index {where}: got {g[where].item():.6g}, reference {ref[where].item():.6g})"
    )


__all__ = ["assert_rel_err", "max_rel_err"]
