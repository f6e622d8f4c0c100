"""W8A8: int8 weights times int8 activations, accumulated exactly (as int32 would).

The activations are quantized per token (``dynamic``: ``s_x = max|x_t| / 127`` for each row) or with
the checkpoint's one ``input_scale`` (``static``), rounded to nearest and clamped to [-127, 127].
Then ``acc = x_q @ w_q.T`` and ``y = acc * s_w * s_x`` in float32.  Where ``acc`` is computed:

- CUDA: ``torch._int_mm`` (cuBLASLt int8 x int8 -> int32; it wants more than 16 rows: fewer are padded);
- CPU with AMX-INT8, checked exact once per process (:func:`cpu_int8_paths`): oneDNN's int8 GEMM
  (``torch.ops.onednn.qlinear_pointwise``, the op torch's own x86 int8 inference runs) on the weight
  packed once at load (:func:`prepack`), given the weight scales and a unit activation scale, so that it
  returns ``acc * s_w`` (rounded once, as torch's product); a weight of fewer than ``SMALL_PRODUCT``
  codes goes through ``torch._int_mm`` instead (oneDNN spends about 25 us per call, and milliseconds in its int8 x int8
  kernel for fewer than 256 outputs and a few rows);
- CPU with VNNI but no AMX (AMD Zen 4, Intel before Sapphire Rapids): ``torch._int_mm``, checked exact the
  same way.  oneDNN has no native kernel there for int8 activations times int8 weights and runs its
  reference one (``ref_int8`` in ``ONEDNN_VERBOSE``): 20 ms for one row of a 1536 x 576 weight on an
  AMD EPYC, 2.4 s for a one-token step of the default model, against 5.4 ms through ``torch._int_mm``;
- CPU otherwise: the codes multiplied as float32 when every partial sum is an integer below 2**24
  (input features <= 1032, as ``127 * 128 * 1032 < 2**24``: activation codes within 127, weight codes
  within 128), else as float64: exact either way, the same ``acc`` as int32.

Every path gives the same ``acc``, hence bit-identical outputs (tests/test_quantization_int8_matmul.py);
:func:`only_cpu_paths` restricts the CPU to some of them within a block, to time or check each alone.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from corerun.platform import host

_INT_MM = hasattr(torch, "_int_mm")
EXACT_FLOAT32 = 2**24 // (127 * 128)  # input features whose products (activations to 127, weights to -128) sum exactly in float32
ROW_BLOCK = 256  # rows multiplied at a time on CPU (int8_linear)
SMALL_PRODUCT = 1 << 18  # weight codes (out * in) below which torch._int_mm is the faster CPU product
INTEGER_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # /proc/cpuinfo flags of exact int8 dot products
ONEDNN_INT8_FLAGS = ("amx_int8",)  # where oneDNN multiplies int8 x int8 natively (elsewhere: its reference kernel)

_lock = threading.Lock()
_cpu_paths: list[str] | None = None


def quantize_activations(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[T, in]`` -> int8 codes ``[T, in]`` and float32 scales ``[T, 1]`` (or ``[1, 1]`` static)."""
    xf = x.float()
    if input_scale is None:
        scale = xf.abs().amax(dim=1, keepdim=True).div_(127.0).clamp_min_(torch.finfo(torch.float32).tiny)
    else:
        scale = input_scale.float().reshape(1, 1).to(x.device)
    return torch.div(xf, scale).round_().clamp_(-127, 127).to(torch.int8), scale


@dataclass(frozen=True)
class PackedInt8:
    """A weight in oneDNN's int8 GEMM layout, with its scales and the zero points the call takes."""

    weight: torch.Tensor  # opaque, from torch.ops.onednn.qlinear_prepack
    scale: torch.Tensor  # float32 [out]
    zeros: torch.Tensor  # int64 [out]

    @classmethod
    def of(cls, weight: torch.Tensor, weight_scale: torch.Tensor) -> "PackedInt8":
        """``weight`` int8 ``[out, in]``, ``weight_scale`` ``[out, 1]`` or one value."""
        out = weight.shape[0]
        packed = torch.ops.onednn.qlinear_prepack(weight.contiguous(), None)
        scale = weight_scale.float().reshape(-1).expand(out).contiguous()
        return cls(packed, scale, torch.zeros(out, dtype=torch.int64))

    def scaled(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes`` int8 ``[T, in]`` -> ``(codes @ weight.T) * weight_scale`` in float32: the int32 sums
        converted and multiplied once, as ``acc.float() * weight_scale`` rounds."""
        return torch.ops.onednn.qlinear_pointwise(
            codes, 1.0, 0, self.weight, self.scale, self.zeros, None, 1.0, 0, torch.float32, "none", [], "",
        )


def _probe() -> list[str]:
    """The integer CPU products exact here (``"onednn"``, with AMX-INT8 only; ``"int_mm"``): each is run on codes
    whose pairs overflow int16 (a u8 x s8 multiply-add without VNNI saturates there) and sums past 2**24,
    against int64."""
    flags = host.cpu_flags()
    if not flags & set(INTEGER_DOT_FLAGS):
        return []
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-128, 128, (64, 1100), generator=g, dtype=torch.int8)
    w[0], w[1] = 127, -128
    x = torch.randint(-127, 128, (3, 1100), generator=g, dtype=torch.int8)
    x[0], x[1] = 127, -127
    want = (x.long() @ w.long().t()).float()
    found = []
    try:
        native = flags & set(ONEDNN_INT8_FLAGS)
        if native and torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise"):
            if torch.equal(PackedInt8.of(w, torch.ones(1)).scaled(x), want):
                found.append("onednn")
    except RuntimeError:
        pass
    try:
        if _INT_MM and torch.equal(torch._int_mm(x, w.t()).float(), want):
            found.append("int_mm")
    except RuntimeError:
        pass
    return found


def cpu_int8_paths() -> list[str]:
    """The integer products W8A8 uses on this CPU (empty: the exact float path), probed once per process."""
    global _cpu_paths
    with _lock:
        if _cpu_paths is None:
            _cpu_paths = _probe()
        return _cpu_paths


@contextlib.contextmanager
def only_cpu_paths(paths: Sequence[str]) -> Iterator[None]:
    """Within the block, W8A8 on CPU uses only ``paths`` of :func:`cpu_int8_paths` (``[]``: the exact
    float path), then what the probe found again: how benchmarks and tests run each path alone.  Sets
    the process's choice (not for use while other threads run products); ``ValueError`` for a path not
    exact here."""
    found = cpu_int8_paths()
    unknown = [p for p in paths if p not in found]
    if unknown:
        raise ValueError(f"int8 CPU paths {unknown} are not exact on this CPU; choose among {found} ([] for the float path)")
    global _cpu_paths
    with _lock:
        _cpu_paths = list(paths)
    try:
        yield
    finally:
        with _lock:
            _cpu_paths = found


def prepack(weight: torch.Tensor, weight_scale: torch.Tensor) -> PackedInt8 | None:
    """``weight`` int8 ``[out, in]`` and its scales packed for oneDNN's int8 GEMM, or ``None`` where that is not used
    (not on CPU, no exact oneDNN product here, or a weight small enough for ``torch._int_mm``)."""
    if weight.device.type != "cpu" or weight.numel() < SMALL_PRODUCT or "onednn" not in cpu_int8_paths():
        return None
    return PackedInt8.of(weight, weight_scale)


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
    packed: PackedInt8 | None = None,
) -> torch.Tensor:
    """``x`` ``[T, in]`` float, ``weight`` int8 ``[out, in]``, ``weight_scale`` ``[out, 1]`` or ``[1, 1]``,
    ``packed`` :func:`prepack`'s form of ``weight`` and ``weight_scale`` (or ``None``) -> ``[T, out]`` in ``x.dtype``.

    On CPU, more than ``ROW_BLOCK`` rows go ``ROW_BLOCK`` at a time (each row's result is its own): a
    prefill's float temporaries are tens of MB, and each fresh one costs its page faults (a 34 MB
    buffer about 25 ms here) where a block's are reused."""
    rows = x.shape[0]
    if rows > ROW_BLOCK and x.device.type == "cpu":
        out = torch.empty(rows, weight.shape[0], dtype=x.dtype)
        for start in range(0, rows, ROW_BLOCK):
            out[start : start + ROW_BLOCK] = int8_linear(x[start : start + ROW_BLOCK], weight, weight_scale, input_scale, packed)
        return out
    codes, x_scale = quantize_activations(x, input_scale)
    if codes.is_cuda and _INT_MM:
        padded = torch.nn.functional.pad(codes, (0, 0, 0, max(0, 17 - rows)))
        acc = torch._int_mm(padded, weight.t())[:rows].float()
    elif packed is not None:
        return packed.scaled(codes).mul_(x_scale).to(x.dtype)
    elif codes.device.type == "cpu" and "int_mm" in cpu_int8_paths():
        acc = torch._int_mm(codes, weight.t()).float()
    else:
        exact = torch.float32 if codes.shape[1] <= EXACT_FLOAT32 else torch.float64
        acc = (codes.to(exact) @ weight.to(exact).t()).float()
    return acc.mul_(weight_scale.float().reshape(1, -1)).mul_(x_scale).to(x.dtype)


@dataclass(frozen=True)
class Int8Weight:
    """A layer's W8A8 shards as one product: the codes stacked ``[out, in]``, ``weight_scale`` float32
    ``[out, 1]``, the static ``input_scale`` (``None``: per token) and :func:`prepack`'s form."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor | None
    packed: PackedInt8 | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight, self.weight_scale, self.input_scale, self.packed)


def merge(shards: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> Int8Weight | None:
    """Shards ``(weight, weight_scale, input_scale)`` that quantize their activations alike (per token,
    or one equal static scale) as one :class:`Int8Weight`, the activations then quantized once per call;
    ``None`` when they differ."""
    statics = [s for _, _, s in shards if s is not None]
    if statics and (len(statics) < len(shards) or any(not torch.equal(s.reshape(()), statics[0].reshape(())) for s in statics)):
        return None
    weight = torch.cat([w for w, _, _ in shards]) if len(shards) > 1 else shards[0][0]
    scale = torch.cat([s.float().reshape(-1, 1).expand(w.shape[0], 1) for w, s, _ in shards])
    return Int8Weight(weight, scale, statics[0] if statics else None, prepack(weight, scale))
