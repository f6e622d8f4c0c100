"""Quantized weights, the sixth plugin kind (docs/quantization.md).

A :class:`QuantizationMethod` stores, loads and applies the weight of every linear layer of a model;
built-ins: ``none`` (dense float) and ``gguf`` (llama.cpp's block formats, read natively).
"""

from corerun.quantization.base import QuantizationMethod, shard_offsets
from corerun.quantization.checkpoint import CheckpointFormat, checkpoint_format, gguf_file_of
from corerun.quantization.gguf_tensor import GGUFLoadError, GGUFTensor

__all__ = [
    "CheckpointFormat", "GGUFLoadError", "GGUFTensor", "QuantizationMethod", "checkpoint_format", "gguf_file_of",
    "shard_offsets",
]
