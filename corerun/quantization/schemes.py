"""The quantized layouts of GPTQ, AWQ, compressed-tensors and FP8 checkpoints, and their decoders.

Each builder returns a :class:`~corerun.quantization.quantized_tensor.Scheme`; the decoders give the
float32 weight ``[out, in]``.  Notation: ``q`` the codes, ``z`` zero points, ``s`` scales, ``g(i)``
the group of input feature ``i``.

- **GPTQ** (``quant_method: gptq``; AutoGPTQ, GPTQModel): ``qweight`` int32 ``[in / (32/b), out]``
  packed along the input, ``qzeros`` int32 ``[G, out / (32/b)]``, ``scales`` float16 ``[G, out]``,
  ``g_idx`` int32 ``[in]`` (``desc_act``: any order; else ``i // group_size``);
  ``w[j, i] = s[g(i), j] * (q[i, j] - z[g(i), j])``; the stored zeros are ``z - 1``
  (``checkpoint_format: gptq``), or ``z`` (``gptq_v2``).
- **AWQ** (``quant_method: awq``, GEMM): ``qweight`` int32 ``[in, out / 8]`` and ``qzeros``
  ``[in / group, out / 8]`` packed along the output in AWQ's interleaved order, ``scales``
  ``[in / group, out]``; ``w[j, i] = s[i // group, j] * (q[i, j] - z[i // group, j])``.
- **compressed-tensors pack-quantized** (W4A16): ``weight_packed`` int32 ``[out, ceil(in / 8)]`` of
  ``q + 8``, ``weight_scale`` ``[out, G]`` (groups) or ``[out, 1]`` (channels), ``weight_zero_point``
  (asymmetric) packed ``[ceil(out / 8), G]``, ``weight_g_idx`` (activation order); ``weight_shape``
  ``[out, in]``; ``w[j, i] = s[j, g(i)] * (q[j, i] - z[j, g(i)])`` with signed ``q``, ``z``.
- **compressed-tensors int-quantized** (W8A8 / W8A16): ``weight`` int8 ``[out, in]``, ``weight_scale``
  ``[out, 1]`` or one value; ``w = s * q``; W8A8 quantizes the activations too (:mod:`.int8_matmul`).
- **FP8** (``quant_method: fp8``, and compressed-tensors float-quantized): ``weight`` float8_e4m3fn
  ``[out, in]``, ``weight_scale`` one value or ``[out, 1]``; ``w = s * float(q)``.
"""

from __future__ import annotations

import torch

from corerun.quantization.int_packing import AWQ_ORDER, per_word, unpack
from corerun.quantization.quantized_tensor import Axes, Codes, QuantizedLoadError, Scheme


def _groups(parts: dict[str, torch.Tensor], key: str, cols: int, group: int) -> torch.Tensor:
    """The group of each of the ``cols`` input features: ``parts[key]`` when stored, else ``i // group``."""
    if key in parts:
        return parts[key].long()
    return torch.arange(cols, device=next(iter(parts.values())).device) // group


def _decode(codes):
    return lambda p, out, cols: codes(p, out, cols).dequantize()


def gptq(bits: int, group_size: int, zeros_offset: int) -> Scheme:
    n = per_word(bits)

    def codes(p: dict[str, torch.Tensor], out: int, cols: int) -> Codes:
        q = unpack(p["qweight"], bits, 0).t()  # [out, in]
        z = (unpack(p["qzeros"], bits, 1) + zeros_offset).t()  # [out, G]
        return Codes(q, z, p["scales"].float().t(), p["g_idx"].long())

    axes = {"qweight": Axes(1, 1, 0, n), "qzeros": Axes(1, n, 0, 0), "scales": Axes(1, 1, 0, 0), "g_idx": Axes(None, 1, 0, 1)}
    return Scheme(f"GPTQ {bits}-bit, groups of {group_size}", axes, _decode(codes), bits=bits, codes=codes)


def awq(group_size: int) -> Scheme:
    def codes(p: dict[str, torch.Tensor], out: int, cols: int) -> Codes:
        q = unpack(p["qweight"], 4, 1, AWQ_ORDER).t()  # [out, in]
        z = unpack(p["qzeros"], 4, 1, AWQ_ORDER).t()  # [out, G]
        return Codes(q, z, p["scales"].float().t(), torch.arange(cols, device=q.device) // group_size)

    axes = {"qweight": Axes(1, 8, 0, 1), "qzeros": Axes(1, 8, 0, group_size), "scales": Axes(1, 1, 0, group_size)}
    return Scheme(f"AWQ 4-bit, groups of {group_size}", axes, _decode(codes), bits=4, codes=codes)


def pack_quantized(bits: int, group_size: int | None, symmetric: bool, actorder: bool) -> Scheme:
    """compressed-tensors ``pack-quantized``; ``group_size`` ``None``: one scale per output channel."""
    n, offset = per_word(bits), 1 << (bits - 1)

    def codes(p: dict[str, torch.Tensor], out: int, cols: int) -> Codes:
        q = unpack(p["weight_packed"], bits, 1)[:, :cols]  # [out, in], each code + offset: unsigned
        s = p["weight_scale"].float()  # [out, G]
        if symmetric:
            z = torch.full(s.shape, offset, dtype=q.dtype, device=q.device)
        else:
            z = unpack(p["weight_zero_point"], bits, 0)[:out]  # [out, G], + offset as the codes
        return Codes(q, z, s, _groups(p, "weight_g_idx", cols, group_size or cols))

    per_group = 0 if actorder else (group_size or 0)
    scale_in = Axes(0, 1, 1 if group_size else None, per_group)
    axes = {"weight_packed": Axes(0, 1, 1, n), "weight_scale": scale_in, "weight_zero_point": Axes(0, n, scale_in.in_dim, per_group),
            "weight_g_idx": Axes(None, 1, 0, 1), "weight_shape": Axes()}
    what = f"groups of {group_size}" if group_size else "per channel"
    def decode_symmetric(p: dict[str, torch.Tensor], out: int, cols: int) -> torch.Tensor:  # no [out, in] zero points to gather
        q = unpack(p["weight_packed"], bits, 1)[:, :cols] - offset
        return q.float() * p["weight_scale"].float()[:, _groups(p, "weight_g_idx", cols, group_size or cols)]

    return Scheme(f"compressed-tensors pack-quantized {bits}-bit, {what}{'' if symmetric else ', zero points'}", axes,
                  decode_symmetric if symmetric else _decode(codes), bits=bits, codes=codes)


def int8(channel: bool, activations: str | None) -> Scheme:
    """compressed-tensors int-quantized: int8 ``weight``, per-channel (``channel``) or per-tensor scale."""

    def decode(p: dict[str, torch.Tensor], out: int, cols: int) -> torch.Tensor:
        return p["weight"].float() * p["weight_scale"].float().reshape(-1, 1)

    def codes(p: dict[str, torch.Tensor], out: int, cols: int) -> Codes:  # one group per row: codes + 128, zero point 128
        q = p["weight"].to(torch.int32) + 128
        s = p["weight_scale"].float().reshape(-1, 1).expand(out, 1).contiguous()
        return Codes(q, torch.full((out, 1), 128, dtype=torch.int32, device=q.device), s,
                     torch.zeros(cols, dtype=torch.int64, device=q.device))

    axes = {"weight": Axes(0, 1, 1, 1), "weight_scale": Axes(0 if channel else None), "input_scale": Axes()}
    act = {"int8-dynamic": ", int8 activations per token", "int8-static": ", int8 activations, static scale"}.get(activations or "", "")
    return Scheme(f"int8 weights per {'channel' if channel else 'tensor'}{act}", axes, decode, bits=8, activations=activations, codes=codes)


def fp8(channel: bool) -> Scheme:
    def decode(p: dict[str, torch.Tensor], out: int, cols: int) -> torch.Tensor:
        return p["weight"].float() * p["weight_scale"].float().reshape(-1, 1)

    axes = {"weight": Axes(0, 1, 1, 1), "weight_scale": Axes(0 if channel else None), "input_scale": Axes()}
    return Scheme(f"FP8 e4m3 weights per {'channel' if channel else 'tensor'}", axes, decode, bits=8)


def check_shapes(name: str, scheme: Scheme, parts: dict[str, torch.Tensor], want: dict[str, tuple[int, ...]]) -> None:
    """Refuse parts whose shapes are not ``want``'s, naming the tensor, both shapes and the scheme."""
    for key, shape in want.items():
        if key in parts and tuple(parts[key].shape) != shape:
            raise QuantizedLoadError(
                f"{name}.{key}: shape {tuple(parts[key].shape)} does not fit {scheme.name}; expected {shape}"
            )
