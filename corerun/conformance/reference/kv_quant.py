"""Reference rounding of quantized KV caches, and the error bound each format implies for attention.

Written from the formats' definitions (frexp and a grid), not with torch's fp8 casts, so that it checks
a backend rather than repeating it.

- fp8 (``x / scale`` rounded to ``m`` mantissa bits, ties to even; subnormal below ``2**min_exp``; saturating):
  an element's error is at most half a step, the step being ``2**-m`` of the value's power of two
  (``2**min_exp`` for subnormals), so at most ``2**-(m+1)`` of the value (e4m3: ``m = 3``, a relative step of ``2**-3``).
- int8 (``round(x / s)`` with ``s = amax(|row|) / 127`` per token and head, rounded up to a float16, stored in
  two bytes): at most ``s / 2`` per element.

Attention over perturbed keys and values (:func:`attention_bound`): a key error moves query row ``r``'s scores
by at most ``delta_r = softmax_scale * max_j sum_i |q_ri| * eps_k[j, i]``, so every probability changes by a
factor within ``exp(+-2 delta_r)`` and the probabilities by at most ``exp(2 delta_r) - 1`` in L1; the output
then moves by at most ``max_j eps_v[j, d] + (exp(2 delta_r) - 1) * (max_j v[j, d] - min_j v[j, d]) / 2``.
"""

from __future__ import annotations

import torch

# name -> (mantissa bits, smallest normal exponent, largest finite value)
FP8_FORMATS: dict[str, tuple[int, int, float]] = {"fp8_e4m3": (3, -6, 448.0), "fp8_e5m2": (2, -14, 57344.0)}


def _round_fp8(y: torch.Tensor, mantissa_bits: int, min_exp: int, largest: float) -> torch.Tensor:
    y = y.to(torch.float64).clamp(-largest, largest)
    _, e = torch.frexp(y)  # y = m * 2**e with 0.5 <= |m| < 1: the power of two is 2**(e - 1)
    step = torch.exp2((e - 1).clamp(min=min_exp).to(torch.float64) - mantissa_bits)
    return torch.round(y / step) * step


def fake_quant(x: torch.Tensor, kv_dtype: str, scale: float = 1.0) -> torch.Tensor:
    """Rows ``[..., head_size]`` quantized as ``kv_dtype`` stores them (from float32) and read back, in float64.
    ``scale``: fp8's per-tensor scale (int8 takes each row's own)."""
    xf = x.to(torch.float32)
    if kv_dtype == "int8":
        s = int8_scale(xf)
        return torch.round(xf.to(torch.float64) / s).clamp(-127, 127) * s
    return _round_fp8(xf / scale, *FP8_FORMATS[kv_dtype]) * scale


def int8_scale(x: torch.Tensor) -> torch.Tensor:
    """int8's scale of each row of ``x`` (float32), float64 ``[..., 1]``: ``amax / 127`` (in float32) rounded up onto
    float16's grid (10 mantissa bits, subnormal below ``2**-14``, at most 65504); 1 for an all-zero row."""
    s = (x.to(torch.float32).abs().amax(-1, keepdim=True) / 127.0).to(torch.float64).clamp(max=65504.0)
    _, e = torch.frexp(s)
    step = torch.exp2((e - 1).clamp(min=-14).to(torch.float64) - 10)
    s = torch.ceil(s / step) * step
    return torch.where(s > 0, s, torch.ones_like(s))


def element_bound(x: torch.Tensor, kv_dtype: str, scale: float = 1.0) -> torch.Tensor:
    """The largest error :func:`fake_quant` may make on each element of ``x`` (float64, ``x``'s shape)."""
    x64 = x.to(torch.float64)
    if kv_dtype == "int8":
        return (int8_scale(x) / 2).expand_as(x64)
    m, min_exp, _ = FP8_FORMATS[kv_dtype]
    _, e = torch.frexp(x64 / scale)  # half the step of the value's binade 2**(e-1) (subnormals: of the lowest)
    return scale * torch.exp2((e - 1).clamp(min=min_exp).to(torch.float64) - m - 1)


def attention_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps_k: torch.Tensor, eps_v: torch.Tensor,
                    context_len: int, softmax_scale: float) -> torch.Tensor:
    """Per-element bound on how far causal attention moves when K/V carry errors up to ``eps_k`` / ``eps_v``.

    One request: ``q`` ``[qlen, Hq, D]`` at positions ``context_len ..``; ``k``/``v``/``eps_k``/``eps_v``
    ``[context_len + qlen, Hkv, D]`` float64.  Returns float64 ``[qlen, Hq, D]``.
    """
    qlen, hq, _ = q.shape
    group = hq // k.shape[1]
    q64 = q.to(torch.float64).abs()
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(qlen):
        n = context_len + t + 1
        ek, ev = eps_k[:n].repeat_interleave(group, 1), eps_v[:n].repeat_interleave(group, 1)  # [n, Hq, D]
        vv = v[:n].to(torch.float64).repeat_interleave(group, 1)
        delta = softmax_scale * torch.einsum("hd,nhd->hn", q64[t], ek).amax(-1)  # [Hq]
        spread = (vv.amax(0) - vv.amin(0)) / 2  # [Hq, D]
        out[t] = ev.amax(0) + torch.expm1(2 * delta)[:, None] * spread
    return out
