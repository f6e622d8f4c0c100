"""float64 reference of what a sampler must draw from, following vLLM's pipeline order.

1. ``logit_bias`` is added;  2. while ``len(output) < min_tokens`` the EOS and ``stop_token_ids`` are
masked;  3. penalties: ``repetition_penalty`` divides positive / multiplies negative logits of every
token in prompt or output, then ``frequency_penalty * count`` and ``presence_penalty`` are subtracted
for tokens in the output;  -- these are the *processed logits*, whose argmax is the greedy token --
4. divide by ``temperature``;  5. ``min_p`` masks tokens whose probability is below ``min_p`` times
the largest;  6. ``top_k`` keeps the k largest;  7. ``top_p`` keeps the smallest set of most likely
tokens (of the distribution renormalised after top-k) whose mass reaches ``top_p``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Sequence

import torch

NEG_INF = float("-inf")


def processed_logits(
    raw: torch.Tensor, params: Any, prompt: Sequence[int], output: Sequence[int], eos_token_ids: Iterable[int] = (),
) -> torch.Tensor:
    """Steps 1-3 on one row: float64 ``[V]`` -> float64 ``[V]``."""
    x = raw.detach().to("cpu", torch.float64).clone()
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    if len(output) < params.min_tokens:
        for token in set(eos_token_ids) | set(params.stop_token_ids):
            x[token] = NEG_INF
    if params.repetition_penalty != 1.0:
        r = params.repetition_penalty
        for token in set(prompt) | set(output):
            value = x[token].item()
            x[token] = value / r if value > 0 else value * r
    for token, count in Counter(output).items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    return x


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


def sampling_distribution(
    raw: torch.Tensor, params: Any, prompt: Sequence[int] = (), output: Sequence[int] = (), eos_token_ids: Iterable[int] = (),
) -> torch.Tensor:
    """The exact distribution of the next token: float64 ``[V]`` summing to 1 (one-hot when greedy)."""
    x = processed_logits(raw, params, prompt, output, eos_token_ids)
    if params.temperature < 1e-5:  # vLLM: temperatures below 1e-5 mean greedy
        probs = torch.zeros_like(x)
        probs[int(torch.argmax(x))] = 1.0
        return probs
    x = x / params.temperature
    if params.min_p > 0.0:
        p = _softmax(x)
        x[p < params.min_p * p.max()] = NEG_INF
    if 0 < params.top_k < x.numel():
        kth = torch.sort(x, descending=True).values[params.top_k - 1]
        x[x < kth] = NEG_INF
    if params.top_p < 1.0:
        p = _softmax(x)
        order = torch.argsort(p, descending=True)
        mass_before = torch.cumsum(p[order], 0) - p[order]
        x[order[mass_before >= params.top_p]] = NEG_INF
    return _softmax(x)


def boundary_margins(raw: torch.Tensor, params: Any, prompt: Sequence[int] = (), output: Sequence[int] = (), eos_token_ids: Iterable[int] = ()) -> dict[str, float]:
    """How far the inputs sit from each truncation threshold (the suite keeps these well above float32 noise)."""
    x = processed_logits(raw, params, prompt, output, eos_token_ids)
    margins: dict[str, float] = {}
    if params.temperature < 1e-5:  # vLLM: temperatures below 1e-5 mean greedy
        top2 = torch.topk(x, 2).values
        margins["greedy"] = (top2[0] - top2[1]).item()
        return margins
    x = x / params.temperature
    if params.min_p > 0.0:
        p = _softmax(x)
        margins["min_p"] = ((p - params.min_p * p.max()).abs().min() / p.max()).item()
        x[p < params.min_p * p.max()] = NEG_INF
    if 0 < params.top_k < x.numel():
        s = torch.sort(x, descending=True).values
        margins["top_k"] = (s[params.top_k - 1] - s[params.top_k]).item()
        x[x < s[params.top_k - 1]] = NEG_INF
    if params.top_p < 1.0:
        p = _softmax(x)
        order = torch.argsort(p, descending=True)
        mass_before = torch.cumsum(p[order], 0) - p[order]
        margins["top_p"] = (mass_before[p[order] > 0] - params.top_p).abs().min().item()
    return margins
