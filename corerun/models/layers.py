"""The building blocks of corerun's models, each parameter carrying its own ``weight_loader``.

A ``weight_loader(param, loaded_weight, shard_id=None)`` copies one checkpoint tensor into a
parameter, or into one shard of a merged parameter (``qkv_proj`` takes ``"q"``, ``"k"``, ``"v"``;
``gate_up_proj`` takes ``"gate"``, ``"up"``).  A shape that does not fit raises
:class:`WeightShapeError` with both shapes; the loader adds the names.

Linear layers are small classes of their own so that a later tensor-parallel split can subclass
them (shard the output features of ``MergedLinear`` per shard, the input features of ``o_proj``
and ``down_proj``) without touching the model code.

On CPU, float32 and bfloat16 weights of the linear layers and the LM head are multiplied through a
copy prepacked once for oneDNN (:class:`PackedWeight`): oneDNN's blocked layout saves the reorder
a plain ``F.linear`` repeats on every call (docs/benchmarks.md has the measurements); the linear layers
are packed at load (:func:`prepack_cpu_weights`), the LM head on first use.  The parameter itself stays an
ordinary tensor, so weight loaders, tying and ``state_dict`` are unchanged; the pack is redone when the
parameter's storage or version changes.  ``CORERUN_CPU_PREPACK=0`` turns it off.

A step of one token (one request decoding) is a matrix-vector product, bound by how fast the weights
stream from memory.  There oneDNN's blocked layout streams slower than a plain product with the
weight stored column by column (``x @ W.T`` with ``W.T`` contiguous: 15 against 12.6 GB/s on one
core of this project's CPU, docs/benchmarks.md), so :func:`use_cpu_matvec_layout` stores each float32
CPU weight that way after loading (same shape and values, strides ``(1, out_features)``), and a
one-token step calls ``F.linear`` on it, as does a float32 step of :data:`MATMUL_MIN_ROWS` tokens or more on an
Intel CPU (MKL's GEMM on that layout is then faster than the pack); the steps between keep the prepacked copy.

A linear layer built with a quantization method (``quant``, :mod:`corerun.quantization`) hands its
weight to the method: the method creates the storage, stores each checkpoint tensor once the layer
has cut its shard and rank's slice, and computes ``x @ W.T``; the layer adds the bias.  A checkpoint
tensor that arrives packed (a GGUF tensor) for a float parameter is dequantized on load.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any, ClassVar, Hashable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from corerun.quantization.base import QuantizationMethod


class WeightShapeError(ValueError):
    """A checkpoint tensor does not fit the parameter (shard) it was meant for."""

    def __init__(self, expected: tuple[int, ...], got: tuple[int, ...]):
        self.expected, self.got = expected, got
        super().__init__(f"expected shape {expected}, checkpoint has {got}")


def as_dense(loaded: Any) -> torch.Tensor:
    """A checkpoint tensor as float values: a packed one (anything with ``dequantize()`` that is not a
    ``torch.Tensor``, such as a GGUF tensor) decoded, a plain one as it is."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.dequantize()


def default_weight_loader(param: nn.Parameter, loaded_weight: Any, shard_id: Hashable = None) -> None:
    """Copy ``loaded_weight`` into ``param`` (any dtype / device; converted on copy; packed: dequantized)."""
    if shard_id is not None:
        raise ValueError(f"this parameter has no shards, got shard {shard_id!r}")
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise WeightShapeError(tuple(param.shape), tuple(loaded_weight.shape))
    param.data.copy_(as_dense(loaded_weight))


def _quantized(quant: "QuantizationMethod | None") -> "QuantizationMethod | None":
    """The method a layer hands its weight to; ``None`` (the float path) for none or a dense method."""
    return None if quant is None or quant.dense else quant


def _parameter(*shape: int) -> nn.Parameter:
    """An uninitialised parameter in the current default dtype / device (every one is loaded from the checkpoint)."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = default_weight_loader  # type: ignore[attr-defined]
    return param


def _prepack_wanted() -> bool:
    return os.environ.get("CORERUN_CPU_PREPACK", "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def _packable_dtypes() -> frozenset[torch.dtype]:
    """float32, and bfloat16 where oneDNN has a bfloat16 path; none without oneDNN (asked once: each question
    is a dispatched operator, 3% of a 32-request bfloat16 decode step when asked per product)."""
    if not torch.backends.mkldnn.is_available():
        return frozenset()
    return frozenset({torch.float32, torch.bfloat16} if torch.ops.mkldnn._is_mkldnn_bf16_supported() else {torch.float32})


def _packable(weight: torch.Tensor) -> bool:
    """A CPU float32 weight (or bfloat16, where oneDNN has a bfloat16 path) that oneDNN can prepack."""
    return weight.dtype in _packable_dtypes() and weight.is_cpu and weight.dim() == 2 and not weight.requires_grad


def _column_major(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.stride(0) == 1 and weight.stride(1) == weight.shape[0]


def use_cpu_matvec_layout(model: nn.Module) -> int:
    """Store every float32 CPU weight of the linear layers and the LM head column by column (see the
    module docstring); a weight tied to the embedding changes with it (a lookup of a few strided rows
    per step).  Returns how many weights were moved.  Nothing changes elsewhere or with
    ``CORERUN_CPU_PREPACK=0``."""
    if not _prepack_wanted():
        return 0
    moved = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, (Linear, LMHead)) or weight is None or weight.dim() != 2:
            continue
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or _column_major(weight):
            continue
        with torch.no_grad():
            weight.data = weight.data.t().contiguous().t()
        moved += 1
    return moved


# From this many rows on, a float32 product on the column-major weight (``F.linear``: MKL's GEMM with no transpose)
# is faster than oneDNN's prepacked one: the default model's 30 layers of products at one thread took 4-6 % less
# at 384, 512, 768, 1024 and 2048 rows, 1-2 % more at 256 and 15 % more at 32; at two threads 1-2 % less from
# 512 rows (benchmarks/RESULTS.md, "Thirteenth session").  Prompts and large batches take it, decodes keep the pack.
# On Intel CPUs with MKL only: on an AMD EPYC (Zen 4) MKL's GEMM took 1.15-1.25x the pack's time from 128 to
# 1024 rows ("Fourteenth session"), and a torch without MKL (another BLAS behind F.linear) was never measured;
# both keep the pack at every size.
MATMUL_MIN_ROWS = 384


@functools.cache
def _matmul_min_rows() -> float:
    from corerun.platform.host import cpu_vendor

    mkl_wins = torch.backends.mkl.is_available() and cpu_vendor() == "GenuineIntel"
    return MATMUL_MIN_ROWS if mkl_wins else float("inf")


class PackedWeight:
    """A weight reordered once into oneDNN's blocked layout, for ``y = x @ weight.T (+ bias)`` on CPU.

    ``linear(x, weight, bias)`` uses the pack when it was made from this very ``weight`` (same storage,
    same version: a weight changed in place is packed again; inference tensors keep no version, so
    one of those is packed once per storage) and plain ``F.linear`` otherwise: other
    devices and dtypes, autograd, or ``CORERUN_CPU_PREPACK=0``.
    """

    __slots__ = ("key", "packed")

    def __init__(self) -> None:
        self.key: tuple[int, int, torch.dtype] | None = None
        self.packed: torch.Tensor | None = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the compiler packs weights itself (inductor's freezing)
            return F.linear(x, weight, bias)
        if x.dtype != weight.dtype or (x.requires_grad and torch.is_grad_enabled()) or not _packable(weight):
            return F.linear(x, weight, bias)
        rows = x.shape[0]
        if (rows == 1 or rows >= _matmul_min_rows()) and weight.dtype == torch.float32 and _column_major(weight):
            return F.linear(x, weight, bias)  # one row streams this layout faster; MKL multiplies many faster on it
        packed = self._pack(weight)
        if packed is None:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    @torch.inference_mode()  # as a step makes it: a pack made outside multiplied 10% slower (quantization/dense_cpu)
    def prepare(self, weight: torch.Tensor) -> bool:
        """Pack ``weight`` now, as the first product of two tokens or more would; whether it did."""
        return _packable(weight) and self._pack(weight) is not None

    def _pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The pack of ``weight`` as it is now (made again when its storage or version changed); None with
        ``CORERUN_CPU_PREPACK=0``.  ``weight`` is :func:`_packable`."""
        key = (weight.data_ptr(), 0 if weight.is_inference() else weight._version, weight.dtype)
        if key != self.key:
            if not _prepack_wanted():
                return None
            self.packed, self.key = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None), key
        return self.packed


def prepack_cpu_weights(model: nn.Module) -> int:
    """Pack every unquantized CPU linear layer's weight for oneDNN at load (:class:`PackedWeight`), so that the
    first prompt does not pay for it: on the default model in float32, 0.5-1.2 s, which the first request's time
    to first token carried before.  The LM head stays lazy: it multiplies two rows or more only when a step
    samples for several requests, and its pack is the embedding's size again.  Returns how many were packed."""
    return sum(m.packed.prepare(m.weight) for m in model.modules() if isinstance(m, Linear) and m.quant is None)


class Linear(nn.Module):
    """``y = x @ weight.T + bias``; ``weight`` ``[out_features, in_features]`` (with ``quant``: what the
    method stores, see :mod:`corerun.quantization.base`)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, quant: "QuantizationMethod | None" = None,
        shard_sizes: Mapping[Hashable, int] | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant = _quantized(quant)
        if self.quant is None:
            self.weight = _parameter(out_features, in_features)
        else:
            self.quant.create_weights(self, in_features, dict(shard_sizes or {None: out_features}))
            self.weight.weight_loader = self._load_quantized  # type: ignore[attr-defined]
        self.bias = _parameter(out_features) if bias else None
        self.packed = PackedWeight()

    def _load_quantized(self, param: nn.Parameter, loaded_weight: Any, shard_id: Hashable = None) -> None:
        if shard_id is not None:
            raise ValueError(f"this parameter has no shards, got shard {shard_id!r}")
        expected = (self.out_features, self.in_features)
        if tuple(loaded_weight.shape) != expected:
            raise WeightShapeError(expected, tuple(loaded_weight.shape))
        self.quant.load_weight(self, loaded_weight, None)  # type: ignore[union-attr]

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` without the bias: ``[T, in_features]`` -> ``[T, out_features]``."""
        return self.packed.linear(x, self.weight, None) if self.quant is None else self.quant.apply(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in_features]`` -> ``[T, out_features]``."""
        if self.quant is None:
            return self.packed.linear(x, self.weight, self.bias)
        y = self.quant.apply(self, x)
        return y if self.bias is None else y + self.bias


class MergedLinear(Linear):
    """Several linear layers over the same input, stacked along the output features.

    ``shard_sizes`` maps a shard id to its output size, in order: ``{"q": Hq*D, "k": Hkv*D, "v": Hkv*D}``
    for ``qkv_proj``, ``{"gate": I, "up": I}`` for ``gate_up_proj``.  Each checkpoint tensor lands in its
    rows of ``weight`` (and ``bias``).
    """

    def __init__(
        self, in_features: int, shard_sizes: Mapping[Hashable, int], bias: bool = False,
        quant: "QuantizationMethod | None" = None,
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias, quant, shard_sizes)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets: dict[Hashable, int] = {}
        offset = 0
        for shard_id, size in self.shard_sizes.items():
            self.shard_offsets[shard_id] = offset
            offset += size
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
                param.shard_ids = tuple(self.shard_sizes)  # type: ignore[attr-defined]  # each must be loaded

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: Hashable = None) -> None:
        if shard_id not in self.shard_sizes:
            raise ValueError(f"unknown shard {shard_id!r}; this layer's shards are {list(self.shard_sizes)}")
        if self.quant is not None and param is self.weight:
            expected = (self.shard_sizes[shard_id], self.in_features)
            if tuple(loaded_weight.shape) != expected:
                raise WeightShapeError(expected, tuple(loaded_weight.shape))
            self.quant.load_weight(self, loaded_weight, shard_id)
            return
        rows = param.data.narrow(0, self.shard_offsets[shard_id], self.shard_sizes[shard_id])
        if tuple(rows.shape) != tuple(loaded_weight.shape):
            raise WeightShapeError(tuple(rows.shape), tuple(loaded_weight.shape))
        rows.copy_(as_dense(loaded_weight))

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``y`` ``[T, out_features]`` -> one view per shard, in ``shard_sizes`` order."""
        return y.split(list(self.shard_sizes.values()), dim=-1)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension, computed in float32; called with a
    ``residual``, the residual add first (a decoder layer's stream, as vLLM's ``fused_add_rms_norm``).

    ``ops``: the engine's ``fused_ops`` implementation (:mod:`corerun.protocols.fused_ops`), set by the
    runner after construction; ``None`` runs the torch code below.  ``add_ops``: the same implementation
    where it has the optional ``add_rms_norm`` (else ``None``: the add runs in torch, the norm through ``ops``)."""

    ops: Any = None
    add_ops: Any = None
    takes_residual: ClassVar[bool] = True  # False for a subclass with a ``forward(x)`` of its own (Gemma's)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.takes_residual = cls.forward is RMSNorm.forward

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _parameter(size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        """``x`` ``[..., size]`` -> same shape and dtype; with ``residual`` (``[T, size]``, ``x``'s shape):
        ``(normed, new_residual)``, ``new_residual = x + residual`` and ``normed`` its norm.

        torch's fused ``rms_norm`` reduces in float32 and rounds once, after the weight (one pass; in bfloat16
        3x faster than the four ops it replaces, and nearer float64: it skips the rounding before the weight)."""
        if residual is not None:
            if self.add_ops is not None:
                return self.add_ops.add_rms_norm(x, residual, self.weight, self.eps)
            if self.ops is not None:  # an implementation without add_rms_norm: its norm after a torch add
                residual = x + residual
                return self.ops.rms_norm(residual, self.weight, self.eps), residual
            return add_rms_norm(x, residual, self.weight, self.eps)
        if self.ops is not None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


class VocabEmbedding(nn.Module):
    """Token embedding table ``weight`` ``[vocab_size, hidden_size]``."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.weight = _parameter(vocab_size, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` int64 ``[T]`` -> ``[T, hidden_size]``."""
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states onto the vocabulary; ``weight`` ``[vocab_size, hidden_size]`` (tied: the embedding's)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = _parameter(vocab_size, hidden_size)
        self.packed = PackedWeight()
        self.quantized: nn.Module | None = None  # set after loading by a method's lm_head(): used in place of weight

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Share ``embedding.weight`` (one parameter, loaded once under either name)."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[N, hidden_size]`` -> logits float32 ``[N, vocab_size]``."""
        if self.quantized is not None:
            return self.quantized(hidden).float()
        return self.packed.linear(hidden, self.weight, None).float()


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = [gate | up]`` ``[T, 2*I]`` -> ``[T, I]``; ``ops`` as for :class:`RMSNorm`."""

    ops: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.silu_and_mul(x)
        return silu_and_mul(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`RMSNorm`'s torch code (and the ``torch`` fused ops'): torch's fused ``rms_norm`` where ``weight``
    has ``x``'s dtype, else float32 math rounded to ``x``'s dtype before the weight."""
    if weight.dtype == x.dtype:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``: one call of an :class:`RMSNorm` that takes the residual (the
    fused add), else the add in torch and ``norm`` on the sum (a subclass or module with a ``forward(x)`` of its own)."""
    if getattr(norm, "takes_residual", False):
        return norm(x, residual)
    residual = x + residual
    return norm(residual), residual


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`RMSNorm`'s torch code with a residual (and the ``torch`` fused ops'): ``(rms_norm(x + residual),
    x + residual)``, the sum rounded to ``x``'s dtype before the norm."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """:class:`SiluAndMul`'s torch code (and the ``torch`` fused ops'): ``silu(gate)`` in a new tensor,
    multiplied by ``up`` in place."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
