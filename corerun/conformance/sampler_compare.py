"""Comparisons of a sampler's output with the float64 references: distribution fit and logprobs."""

from __future__ import annotations

from typing import Any

import torch

from corerun.conformance.reference.sampling import boundary_margins, sampling_distribution
from corerun.conformance.sampler_cases import VOCAB, DistCase, base_logits
from corerun.testing.stats import chi_square_fit

LOGPROB_ATOL, LOGPROB_RTOL = 1e-5, 1e-5


def fit_problems(dist: DistCase, tokens: torch.Tensor) -> list[str]:
    """Draws ``tokens`` int64 ``[N]`` from ``base_logits()`` under ``dist`` against the exact distribution:
    excluded tokens never drawn, and a chi-square fit with p above the significance level."""
    params = dist.sampling_params()
    for name, margin in boundary_margins(base_logits(), params, dist.prompt, dist.output, dist.eos).items():
        if margin < 1e-3:
            raise RuntimeError(f"suite input for {dist.name} sits {margin:g} from the {name} threshold")
    probs = sampling_distribution(base_logits(), params, dist.prompt, dist.output, dist.eos)
    counts = torch.bincount(tokens, minlength=VOCAB).to(torch.float64)
    problems = []
    impossible = torch.nonzero((probs == 0) & (counts > 0)).flatten().tolist()
    if impossible:
        shown = ", ".join(f"token {t} drawn {int(counts[t])} times" for t in impossible[:5])
        problems.append(f"{dist.name}: tokens the parameters exclude were drawn: {shown} ({dist.params})")
    fit = chi_square_fit(counts, probs)
    if not fit.ok:
        problems.append(f"{dist.name} ({dist.params}): {fit.describe()}")
    return problems


def logprob_problems(raw: torch.Tensor, tokens: torch.Tensor, lp: Any, ks: list[int | None]) -> list[str]:
    """``lp`` (LogprobsTensors) against ``log_softmax`` of float32 ``raw`` ``[B, V]`` in float64: column 0
    is ``tokens[r]`` with its logprob and rank, then the top ``ks[r]`` (rows with ``None`` are padding)."""
    problems: list[str] = []
    width = 1 + max(k for k in ks if k is not None)
    ids, vals, ranks = lp.token_ids.cpu(), lp.logprobs.cpu().to(torch.float64), lp.ranks.cpu()
    if ids.shape[0] != len(ks) or ids.shape[1] < width or vals.shape != ids.shape or tuple(ranks.shape) != (len(ks),):
        return [f"logprob tensors have shapes {tuple(ids.shape)}, {tuple(vals.shape)}, {tuple(ranks.shape)}; "
                f"expected ({len(ks)}, >= {width}) twice and ({len(ks)},)"]
    for r, k in enumerate(ks):
        if k is None:
            continue
        ref = torch.log_softmax(raw[r].to(torch.float64), dim=-1)
        tok = int(tokens[r])
        close = lambda a, b: abs(a - b) <= LOGPROB_ATOL + LOGPROB_RTOL * abs(b)  # noqa: E731
        if int(ids[r, 0]) != tok:
            problems.append(f"row {r}: column 0 holds token {int(ids[r, 0])}, the sampled/given token is {tok}")
        elif not close(vals[r, 0].item(), ref[tok].item()):
            problems.append(f"row {r}: logprob of token {tok} is {vals[r, 0].item():.6f}, log_softmax of the raw logits gives {ref[tok].item():.6f}")
        want_rank = 1 + int((ref > ref[tok]).sum())
        if int(ranks[r]) != want_rank:
            problems.append(f"row {r}: rank of token {tok} is {int(ranks[r])}, expected {want_rank}")
        top = torch.topk(ref, k) if k else None
        for j in range(k):
            t, v = int(ids[r, 1 + j]), vals[r, 1 + j].item()
            if t != int(top.indices[j]) or not close(v, top.values[j].item()):
                problems.append(
                    f"row {r}: top-{k} column {j + 1} is token {t} ({v:.6f}); expected token {int(top.indices[j])} "
                    f"({top.values[j].item():.6f})"
                )
                break
    return problems
