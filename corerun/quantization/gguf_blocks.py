"""GGUF (ggml) block layouts, and their dequantization in plain torch.

A quantized GGUF tensor of logical shape ``[rows, cols]`` is stored row by row, each row cut into
blocks of ``block_size`` consecutive values (along ``cols``, the input features of a linear layer)
of ``type_size`` bytes each: ``data`` is uint8 ``[rows, cols // block_size * type_size]``.  So a
range of rows is a range of ``data`` rows, and a range of columns is a range of whole blocks when it
starts and ends on a block boundary.

Layouts (``f16`` little-endian halves; ``q`` the stored codes; ``y`` the values of one block):

- ``Q8_0`` (32 values, 34 bytes): ``d: f16``, ``qs: int8[32]``; ``y = d * qs``.
- ``Q4_0`` (32, 18): ``d``, ``qs: u8[16]``; values 0-15 are the low nibbles, 16-31 the high ones;
  ``y = d * (q - 8)``.
- ``Q4_1`` (32, 20): ``d``, ``m: f16``, ``qs: u8[16]`` as Q4_0; ``y = d * q + m``.
- ``Q4_K`` (256, 144): ``d``, ``dmin: f16``, ``scales: u8[12]`` (eight 6-bit scales and eight 6-bit
  mins), ``qs: u8[128]``; sub-block ``s`` of 32 values: ``y = d * sc[s] * q - dmin * mn[s]``; chunk
  ``j`` of 64 values takes the low nibbles of ``qs[32j:32j+32]`` (sub-block ``2j``), then the high ones.
- ``Q5_K`` (256, 176): ``d``, ``dmin``, ``scales: u8[12]``, ``qh: u8[32]``, ``qs: u8[128]``; as Q4_K
  with a fifth bit: bit ``s`` of ``qh[l]`` is the high bit of value ``l`` of sub-block ``s``.
- ``Q6_K`` (256, 210): ``ql: u8[128]``, ``qh: u8[64]``, ``scales: int8[16]``, ``d: f16``; sixteen
  sub-blocks of 16; ``y = d * sc[s] * (q - 32)`` with ``q`` six bits (low four from ``ql``, high two
  from ``qh``; the order is in :func:`_q6_k`).
- ``F32``, ``F16``, ``BF16``: plain values (block size 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class BlockLayout:
    name: str
    block_size: int  # values per block
    type_size: int  # bytes per block
    bits: float  # bits per value, scales included


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 2]`` -> float32 ``[...]`` (little-endian float16)."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, 0:2])
    q = b[:, 2:34].contiguous().view(torch.int8).float()
    return d[:, None] * q


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """u8 ``[N, 16]`` -> codes ``[N, 32]``: low nibbles first, then high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, 0:2])[:, None] * (_nibbles(b[:, 2:18]) - 8.0)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, 0:2])[:, None] * _nibbles(b[:, 4:20]) + _f16(b[:, 2:4])[:, None]


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed in ``s`` u8 ``[N, 12]`` -> two float ``[N, 8]``."""
    s = s.long()
    lo_sc, lo_m = s[:, 0:4] & 63, s[:, 4:8] & 63
    hi_sc = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    hi_m = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], 1).float(), torch.cat([lo_m, hi_m], 1).float()


def _k_codes4(qs: torch.Tensor) -> torch.Tensor:
    """u8 ``[N, 128]`` -> codes ``[N, 8, 32]`` (sub-block order: chunk j low nibbles, then high)."""
    q = qs.view(-1, 4, 1, 32)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(-1, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    q = _k_codes4(b[:, 16:144]).float()
    y = (d[:, None] * sc)[:, :, None] * q - (dmin[:, None] * mn)[:, :, None]
    return y.reshape(-1, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48]  # [N, 32]
    high = torch.stack([(qh >> s) & 1 for s in range(8)], dim=1)  # [N, 8, 32]
    q = (_k_codes4(b[:, 48:176]) | (high << 4)).float()
    y = (d[:, None] * sc)[:, :, None] * q - (dmin[:, None] * mn)[:, :, None]
    return y.reshape(-1, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql, qh = b[:, 0:128].view(-1, 2, 2, 32), b[:, 128:192].view(-1, 2, 1, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float()  # [N, 16]
    d = _f16(b[:, 208:210])
    # per half of 128 values: ql[0:32], ql[32:64] low nibbles, then their high nibbles; qh's bit pairs 0-3 on top
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # [N, 2, 4, 32]
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2)  # [N, 2, 4, 32]
    q = (low | (high << 4)).float() - 32.0
    y = q.view(-1, 16, 16) * sc[:, :, None]
    return (d[:, None, None] * y).reshape(-1, 256)


LAYOUTS: dict[str, BlockLayout] = {
    layout.name: layout
    for layout in (
        BlockLayout("F32", 1, 4, 32), BlockLayout("F16", 1, 2, 16), BlockLayout("BF16", 1, 2, 16),
        BlockLayout("Q8_0", 32, 34, 8.5), BlockLayout("Q4_0", 32, 18, 4.5), BlockLayout("Q4_1", 32, 20, 5.0),
        BlockLayout("Q4_K", 256, 144, 4.5), BlockLayout("Q5_K", 256, 176, 5.5), BlockLayout("Q6_K", 256, 210, 6.5625),
    )
}
_DECODE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}
QUANTIZED = frozenset(_DECODE)  # the block types corerun reads packed
PLAIN = frozenset({"F32", "F16", "BF16"})


def dequantize(data: torch.Tensor, type_name: str, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 ``data`` ``[rows, cols // block_size * type_size]`` of GGML type ``type_name`` -> ``[rows, cols]`` in ``dtype``.

    Each block is decoded in float32 (the scales are float16, the codes at most 8 bits: exact there).
    """
    layout = LAYOUTS[type_name]
    rows = data.shape[0]
    if type_name in PLAIN:
        plain = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[type_name]
        return data.contiguous().view(plain).reshape(rows, cols).to(dtype)
    blocks = data.reshape(-1, layout.type_size)
    return _DECODE[type_name](blocks).reshape(rows, cols).to(dtype)
