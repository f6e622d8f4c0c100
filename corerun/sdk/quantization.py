"""What a quantization method builds on (imports torch).

- :class:`DenseMethod`: the built-in ``none`` method (unquantized weights: one ``[out, in]`` weight per
  layer, merged and tensor-parallel shards stacked in order, ``F.linear``); subclass it to multiply dense
  weights with a kernel of your own, keeping its loading.

- :class:`CompressedTensorsMethod`: the built-in ``compressed-tensors`` method (the formats llm-compressor
  and ``corerun quantize`` write; W8A8 layers merged once loaded into an ``Int8Weight``, ``layer.int8``:
  int8 codes ``weight`` ``[out, in]``, float32 ``weight_scale`` ``[out, 1]``, ``input_scale`` ``None``
  when the activations are quantized per token); subclass it to route some products to a kernel.
- :class:`GPTQMethod`, :class:`AWQMethod`: the built-in ``gptq`` and ``awq`` methods (``PackedMethod``s as
  ``compressed-tensors`` is: one :class:`QuantizedTensor` per shard in ``layer.quantized``, decoded per call).
- :class:`QuantizedTensor`: one shard of a packed checkpoint as ``load_weight`` receives it (``parts``
  by name, ``scheme``, ``out_features`` x ``in_features``; ``codes()``: a group-wise integer format's codes,
  zero points, scales and groups unpacked, :class:`Codes`), and :func:`int8_scheme` (``channel``,
  ``activations``: ``"int8-dynamic"``, ``"int8-static"`` or ``None``), the compressed-tensors int8
  scheme a reader gives such a shard: to build W8A8 shards by hand, as a method's tests do.
- :class:`GGUFMethod`: the built-in ``gguf`` method (packed blocks kept as stored, dequantized per
  layer on every call); subclass it and override ``apply`` to route some products to a kernel of
  your own, keeping its loading, merged and tensor-parallel shards.
- :class:`GGUFTensor`: one shard's packed blocks with its GGML type, and ``dequantize(dtype)``.
- :func:`find_default_gguf`: the built-in default model's shipped GGUF file (Q4_1), a real file to
  test a GGUF method on.

The capabilities ``gguf`` declares are :data:`corerun.sdk.GGUF_CAPABILITIES` (no torch there).
"""

from __future__ import annotations

from corerun.models.default import find_default_gguf
from corerun.quantization.dense import DenseMethod
from corerun.quantization.gguf_method import GGUFMethod
from corerun.quantization.gguf_tensor import GGUFTensor
from corerun.quantization.packed_method import AWQMethod, CompressedTensorsMethod, GPTQMethod
from corerun.quantization.quantized_tensor import Codes, QuantizedTensor
from corerun.quantization.schemes import int8 as int8_scheme

__all__ = [
    "AWQMethod", "Codes", "CompressedTensorsMethod", "DenseMethod", "GGUFMethod", "GGUFTensor", "GPTQMethod", "QuantizedTensor",
    "find_default_gguf", "int8_scheme",
]
