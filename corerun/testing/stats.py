"""Chi-square goodness of fit without scipy: ``torch.special.gammaincc`` for the p-value and the
Wilson-Hilferty approximation for the critical value quoted in messages."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The suite rejects a sampler when the chance of a fit at least this bad is below SIGNIFICANCE.
SIGNIFICANCE = 1e-4
MIN_EXPECTED = 5.0  # bins with fewer expected draws are pooled


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, x/2)."""
    if df <= 0:
        return 1.0
    s = torch.tensor(df / 2.0, dtype=torch.float64)
    x = torch.tensor(max(statistic, 0.0) / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(s, x))


def chi2_critical(df: int, alpha: float = SIGNIFICANCE) -> float:
    """The (1 - alpha) quantile of chi-square(df), Wilson-Hilferty: df * (1 - 2/(9df) + z sqrt(2/(9df)))^3."""
    z = float(torch.special.ndtri(torch.tensor(1.0 - alpha, dtype=torch.float64)))
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


@dataclass
class FitResult:
    statistic: float
    df: int
    p_value: float
    critical: float
    worst: str  # the bin contributing most, for the message

    @property
    def ok(self) -> bool:
        return self.p_value > SIGNIFICANCE

    def describe(self) -> str:
        return (
            f"chi-square {self.statistic:.1f} on {self.df} degrees of freedom, p = {self.p_value:.3g} "
            f"(rejected below {SIGNIFICANCE:g}; critical value about {self.critical:.1f}); worst bin: {self.worst}"
        )


def chi_square_fit(counts: torch.Tensor, probs: torch.Tensor) -> FitResult:
    """Fit of observed ``counts`` ``[V]`` to float64 ``probs`` ``[V]`` (zero-probability tokens excluded;
    the caller checks those exactly).  Bins expecting fewer than ``MIN_EXPECTED`` draws are pooled."""
    counts = counts.to(torch.float64).cpu()
    probs = probs.to(torch.float64).cpu()
    n = counts.sum().item()
    support = probs > 0
    expected = probs[support] * n
    observed = counts[support]
    ids = torch.nonzero(support).flatten().tolist()
    big = expected >= MIN_EXPECTED
    obs_bins = observed[big].tolist()
    exp_bins = expected[big].tolist()
    labels = [f"token {ids[i]}" for i in torch.nonzero(big).flatten().tolist()]
    if (~big).any():
        obs_bins.append(observed[~big].sum().item())
        exp_bins.append(expected[~big].sum().item())
        labels.append("pooled rare tokens")
    terms = [(o - e) ** 2 / e for o, e in zip(obs_bins, exp_bins) if e > 0]
    statistic = float(sum(terms))
    df = max(len(terms) - 1, 0)
    worst_i = max(range(len(terms)), key=terms.__getitem__) if terms else 0
    worst = f"{labels[worst_i]} drawn {obs_bins[worst_i]:.0f} times, expected {exp_bins[worst_i]:.1f}" if terms else "-"
    return FitResult(statistic, df, chi2_sf(statistic, df), chi2_critical(df) if df else 0.0, worst)
