"""Reference quantizers for the formats checkpoints store with a ``quantization_config``, in plain float64 torch.

Each :class:`Format` quantizes random float64 weights round-to-nearest, writes the tensors one layer
of a checkpoint would hold (GPTQ's ``qweight`` / ``qzeros`` / ``scales`` / ``g_idx``, AWQ's, llm-compressor's
``weight_packed`` / ``weight_scale`` / ``weight_zero_point`` / ``weight_shape``, int8 and FP8 ``weight``
with ``weight_scale``) with the ``quantization_config`` beside them, and decodes its own integer codes
into the reference weight ``W`` in float64 (never from the packed words: the packing is what a method
under test must undo).  Packing is written out word by word from each format's description:

- GPTQ: ``qweight[r, j]`` holds ``q[8r + k, j]`` at bits ``4k`` (8-bit: ``q[4r + k, j]`` at ``8k``);
  ``qzeros[g, c]`` holds ``z[g, 8c + k] - 1``;
- AWQ: ``qweight[i, c]`` holds ``q[i, 8c + (0, 2, 4, 6, 1, 3, 5, 7)[k]]`` at bits ``4k``; ``qzeros`` alike;
- compressed-tensors: ``weight_packed[j, c]`` holds ``q[j, 8c + k] + 8`` at bits ``4k`` (signed codes);
  ``weight_zero_point[r, g]`` holds ``z[8r + k, g] + 8``.

``bound``: per element, how far ``W`` may be from the float64 weights by the format (half a step, with
the rounding of a float16 / bfloat16 scale; FP8's half unit in the last place).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

AWQ_NIBBLES = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class Quantized:
    config: dict[str, Any]  # quantization_config
    tensors: dict[str, torch.Tensor]  # part name -> tensor, for one layer
    weight: torch.Tensor  # float64 [out, in], decoded from the codes
    original: torch.Tensor  # float64 [out, in], before quantization
    bound: torch.Tensor  # float64 [out, in], the format's bound on |weight - original|
    act_step: bool = False  # W8A8: the layer quantizes its activations per token (to int8, 127 levels)


@dataclass(frozen=True)
class Format:
    name: str
    quant_method: str
    quantize: Callable[[torch.Tensor], Quantized]  # float64 [out, in] -> one layer's checkpoint
    odd: tuple[int, int] | str  # an output x input shape off every boundary it allows, or why none

    def make(self, rows: int, cols: int, seed: int) -> Quantized:
        """Random float64 weights ``[rows, cols]``, quantized."""
        return self.quantize(_weights(rows, cols, seed))


def _words(codes: torch.Tensor, order: tuple[int, ...] = tuple(range(8)), bits: int = 4) -> torch.Tensor:
    """int ``codes`` ``[..., 8n]`` (each below ``2**bits``) -> int32: code ``order[k]`` of each ``32 / bits`` at bits ``bits * k``."""
    per = 32 // bits
    runs = codes.long().reshape(*codes.shape[:-1], -1, per)
    word = torch.zeros(runs.shape[:-1], dtype=torch.int64)
    for k, source in enumerate(order[:per]):
        word = word + (runs[..., source] << (bits * k))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g, dtype=torch.float64) * 0.05 + 0.01 * torch.randn(rows, 1, generator=g, dtype=torch.float64)


def _asym(w: torch.Tensor, scale_dtype: torch.dtype, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` ``[..., n]`` -> codes ``0..2**bits-1``, zero points from 1 and scales ``[..., 1]`` (min-max, zero exact)."""
    top = 2**bits - 1
    lo, hi = w.amin(-1, keepdim=True).clamp(max=0), w.amax(-1, keepdim=True).clamp(min=0)
    s = ((hi - lo) / top).to(scale_dtype).double()
    z = torch.round(-lo / s).clamp(1, top)
    q = (torch.round(w / s) + z).clamp(0, top)
    return q, z, s


def _gptq(act_order: bool, bits: int = 4) -> Callable[[torch.Tensor], Quantized]:
    def make(w: torch.Tensor) -> Quantized:
        group, (rows, cols) = 32, w.shape
        g_idx = torch.arange(cols) // group
        if act_order:  # desc_act: the groups follow a permutation of the input features
            g_idx = g_idx[torch.randperm(cols, generator=torch.Generator().manual_seed(cols))]
        n_groups = -(-cols // group)
        q, z, s = torch.zeros(cols, rows), torch.zeros(n_groups, rows), torch.zeros(n_groups, rows, dtype=torch.float64)
        for g in range(n_groups):
            cols_g = (g_idx == g).nonzero().flatten()
            qg, zg, sg = _asym(w[:, cols_g], torch.float16, bits)
            q[cols_g], z[g], s[g] = qg.t().float(), zg.flatten().float(), sg.flatten()
        weight = ((q.double() - z.double()[g_idx]) * s[g_idx]).t()
        tensors = {
            "qweight": _words(q.t().long(), bits=bits).t().contiguous(),  # input features packed: 32 / bits rows per word
            "qzeros": _words(z.long() - 1, bits=bits), "scales": s.half(), "g_idx": g_idx.to(torch.int32),
        }
        config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": False,
                  "checkpoint_format": "gptq"}
        return Quantized(config, tensors, weight, w, _step_bound(s[g_idx].t(), 2**-11, 2**bits))

    return make


def _step_bound(step: torch.Tensor, scale_eps: float, levels: int = 16) -> torch.Tensor:
    """Half a step, plus the rounding of the scale (relative ``scale_eps``) times the largest of ``levels`` codes."""
    return step * (0.5 + levels * scale_eps) + 1e-12


def _awq(w: torch.Tensor) -> Quantized:
    group, (rows, cols) = 32, w.shape
    q, z, s = _asym(w.reshape(rows, cols // group, group), torch.float16)  # [out, G, group], [out, G, 1]
    weight = ((q - z) * s).reshape(rows, cols)
    tensors = {
        "qweight": _words(q.reshape(rows, cols).t(), AWQ_NIBBLES),  # [in, out / 8]
        "qzeros": _words(z[..., 0].t(), AWQ_NIBBLES), "scales": s[..., 0].t().half().contiguous(),
    }
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return Quantized(config, tensors, weight, w, _step_bound(s.expand(-1, -1, group).reshape(rows, cols), 2**-11))


def _ct_config(fmt: str, weights: dict[str, Any], activations: dict[str, Any] | None = None) -> dict[str, Any]:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations, "output_activations": None, "format": fmt}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
            "ignore": ["lm_head"], "quantization_status": "compressed", "kv_cache_scheme": None}


def _ct_pack(symmetric: bool, bits: int = 4, group: int | None = 32) -> Callable[[torch.Tensor], Quantized]:
    """pack-quantized, ``bits`` per code; ``group`` ``None``: one scale (and zero point) per output channel."""
    half = 2 ** (bits - 1)  # codes -half .. half - 1, stored as code + half

    def make(w: torch.Tensor) -> Quantized:
        rows, cols = w.shape
        n_groups = -(-cols // group) if group else 1
        width = group or cols
        padded = torch.nn.functional.pad(w, (0, n_groups * width - cols)).reshape(rows, n_groups, width)
        if symmetric:
            s = (padded.abs().amax(-1, keepdim=True) / (half - 0.5)).bfloat16().double()
            z = torch.zeros_like(s)
        else:
            _, z_u, s = _asym(padded, torch.bfloat16, bits)
            z = z_u - half
        q = (torch.round(padded / s) + z).clamp(-half, half - 1)
        weight = ((q - z) * s).reshape(rows, -1)[:, :cols]
        per = 32 // bits
        codes = torch.nn.functional.pad((q.reshape(rows, -1)[:, :cols] + half).long(), (0, -cols % per))
        tensors = {"weight_packed": _words(codes, bits=bits), "weight_scale": s[..., 0].bfloat16(), "weight_shape": torch.tensor([rows, cols])}
        if not symmetric:
            zp = torch.nn.functional.pad((z[..., 0] + half).long().t(), (0, -rows % per))  # [G, out] -> packed along out
            tensors["weight_zero_point"] = _words(zp, bits=bits).t().contiguous()
        args = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group" if group else "channel",
                "group_size": group, "dynamic": False, "actorder": None, "observer": "minmax"}
        bound = _step_bound(s.expand(-1, -1, width).reshape(rows, -1)[:, :cols], 2**-8, 2**bits)
        return Quantized(_ct_config("pack-quantized", args), tensors, weight, w, bound)

    return make


def _ct_w8a8(w: torch.Tensor) -> Quantized:
    cols = w.shape[1]
    s = (w.abs().amax(-1, keepdim=True) / 127).bfloat16().double()
    q = torch.round(w / s).clamp(-128, 127)
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False, "observer": "minmax"}
    activations = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True, "observer": None}
    tensors = {"weight": q.to(torch.int8), "weight_scale": s.bfloat16()}
    return Quantized(_ct_config("int-quantized", weights, activations), tensors, q * s, w, _step_bound(s.expand(-1, cols), 2**-8, 256), act_step=True)


def _fp8(per_channel: bool, compressed_tensors: bool) -> Callable[[torch.Tensor], Quantized]:
    def make(w: torch.Tensor) -> Quantized:
        top = w.abs().amax(-1, keepdim=True) if per_channel else w.abs().amax().reshape(1, 1)
        s = (top / 448).float().double()
        q = (w / s).to(torch.float8_e4m3fn)
        weight = q.double() * s
        # e4m3: 3 mantissa bits, half an ulp is 2**-4 of the value; subnormals step by 2**-9
        bound = 2**-4 * w.abs() * (1 + 2**-3) + s * 2**-10 + 1e-12
        tensors = {"weight": q, "weight_scale": s.float() if per_channel else s.float().reshape(())}
        if compressed_tensors:
            args = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel" if per_channel else "tensor", "dynamic": False}
            acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
            return Quantized(_ct_config("float-quantized", args, acts), tensors, weight, w, bound)
        return Quantized({"quant_method": "fp8", "activation_scheme": "dynamic"}, tensors, weight, w, bound)

    return make


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("gptq-4bit-g32", "gptq", _gptq(False), (8, 80)),
    Format("gptq-4bit-g32-act-order", "gptq", _gptq(True), (8, 80)),
    Format("gptq-8bit-g32", "gptq", _gptq(False, 8), (8, 80)),
    Format("awq-4bit-g32", "awq", _awq, "AWQ packs eight output features per word and whole groups of 32 inputs"),
    Format("ct-w4a16-g32", "compressed-tensors", _ct_pack(True), (7, 100)),
    Format("ct-w4a16-channel-asym", "compressed-tensors", _ct_pack(False, group=None), (7, 100)),
    Format("ct-w8a16-pack-channel", "compressed-tensors", _ct_pack(True, bits=8, group=None), (7, 100)),
    Format("ct-w8a8-int8", "compressed-tensors", _ct_w8a8, (7, 100)),
    Format("ct-fp8-channel", "compressed-tensors", _fp8(True, True), (7, 100)),
    Format("fp8-tensor", "fp8", _fp8(False, False), (7, 100)),
)}
