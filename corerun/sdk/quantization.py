"""What a quantization method builds on (imports torch).

- :class:`DenseMethod`: the built-in ``none`` method (unquantized weights: one ``[out, in]`` weight per
  layer, merged and tensor-parallel shards stacked in order, ``F.linear``); subclass it to multiply dense
  weights with a kernel of your own, keeping its loading.

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

__all__ = ["DenseMethod", "GGUFMethod", "GGUFTensor", "find_default_gguf"]
