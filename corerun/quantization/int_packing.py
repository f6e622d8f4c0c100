"""Integer codes packed into int32 words, as GPTQ, AWQ and compressed-tensors store them.

A word holds ``32 // bits`` codes of ``bits`` bits (4 or 8), the first at bits 0..bits-1.  The
formats differ in which axis they pack along and in what order:

- GPTQ ``qweight`` ``[in // 8, out]``: word ``(r, j)`` holds input features ``8r .. 8r+7`` of output
  ``j``, in order; ``qzeros`` ``[groups, out // 8]`` packs the output features, in order.
- AWQ ``qweight`` ``[in, out // 8]`` and ``qzeros`` ``[groups, out // 8]`` pack the output features
  interleaved: nibble ``p`` of a word holds feature ``AWQ_ORDER[p]`` of its eight.
- compressed-tensors ``weight_packed`` ``[out, ceil(in / 8)]`` packs the input features in order,
  each code stored as ``code + 2**(bits-1)`` (its codes are signed); ``weight_zero_point`` packs the
  output features the same way.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the feature each nibble of an AWQ word holds
AWQ_UNDO = (0, 4, 1, 5, 2, 6, 3, 7)  # the nibble that holds each feature: AWQ_UNDO[AWQ_ORDER[p]] == p


def per_word(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"bits: {bits} codes per int32 word are not read by corerun; it reads 4 or 8")
    return 32 // bits


def unpack(words: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 ``words`` -> int32 codes, ``dim`` ``32 // bits`` times longer (``order``: the feature each
    position of a word holds, AWQ's interleave; ``None``: in order)."""
    n = per_word(bits)
    dim = dim % words.dim()
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    shape = [1] * (words.dim() + 1)
    shape[dim + 1] = n
    codes = (words.unsqueeze(dim + 1) >> shifts.view(shape)) & ((1 << bits) - 1)
    if order is not None:
        undo = [order.index(feature) for feature in range(n)]
        codes = codes.index_select(dim + 1, torch.tensor(undo, device=words.device))
    new_shape = list(words.shape)
    new_shape[dim] *= n
    return codes.reshape(new_shape)


def pack(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``codes`` (each ``< 2**bits``) -> int32 words along ``dim``, in order; ``dim`` is
    padded with zero codes to a whole number of words."""
    n = per_word(bits)
    dim = dim % codes.dim()
    codes = codes.to(torch.int64)
    pad = -codes.shape[dim] % n
    if pad:
        widths = [0, 0] * (codes.dim() - 1 - dim) + [0, pad]
        codes = torch.nn.functional.pad(codes, widths)
    shape = list(codes.shape)
    shape[dim : dim + 1] = [shape[dim] // n, n]
    grouped = codes.reshape(shape)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=codes.device)
    view = [1] * grouped.dim()
    view[dim + 1] = n
    words = (grouped << shifts.view(view)).sum(dim + 1)
    return (words - (((words >> 31) & 1) << 32)).to(torch.int32)  # the word's bits, as a signed int32
