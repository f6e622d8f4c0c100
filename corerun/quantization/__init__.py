"""Quantized weights, the sixth plugin kind (docs/quantization.md).

A :class:`QuantizationMethod` stores, loads and applies the weight of every linear layer of a model;
built-ins: ``none`` (dense float) and ``gguf`` (llama.cpp's block formats, read natively).  Importing
this package imports no torch (the registry reads :mod:`corerun.quantization.capabilities`); the
names below load their modules when first used.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "QuantizationMethod": "base", "shard_offsets": "base",
    "CheckpointFormat": "checkpoint", "checkpoint_format": "checkpoint", "gguf_file_of": "checkpoint",
    "GGUFLoadError": "gguf_tensor", "GGUFTensor": "gguf_tensor",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'corerun.quantization' has no attribute {name!r}")
    return getattr(importlib.import_module(f"corerun.quantization.{_WHERE[name]}"), name)


__all__ = sorted(_WHERE)
