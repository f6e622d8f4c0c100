"""A random Llama-shaped model folder for the GPU scripts: 64-dim heads, 4 query heads per KV head,
an MLP three times the hidden size, a 32,000-token vocabulary (written with transformers)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any


def random_llama(hidden: int, layers: int, max_len: int, prefix: str, **overrides: Any) -> Path:
    """Write the model into a new temporary folder and return it (``overrides``: more config keys or ``dtype``)."""
    from tests.helpers.tiny_models import make_tiny_model

    heads = hidden // 64
    return make_tiny_model(
        tempfile.mkdtemp(prefix=prefix), arch="llama", hidden_size=hidden, intermediate_size=hidden * 3,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
        vocab_size=32000, max_position_embeddings=max_len, **overrides,
    )
