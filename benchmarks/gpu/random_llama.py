"""A random Llama-shaped model folder for the GPU scripts: 64-dim heads, 4 query heads per KV head,
an MLP three times the hidden size, a 32,000-token vocabulary (written with transformers).

With ``$CORERUN_GPU_SCRATCH`` set (``run.sh`` sets it), a model of the same shape is written once
per run into that folder and reused by the later parts."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any


def random_llama(hidden: int, layers: int, max_len: int, prefix: str, **overrides: Any) -> Path:
    """Write the model into a new folder and return it (``overrides``: more config keys or ``dtype``,
    a ``torch.dtype`` or its name: ``"bfloat16"``)."""
    scratch = os.environ.get("CORERUN_GPU_SCRATCH")
    if scratch:
        key = "-".join(f"{k}={v}" for k, v in sorted(overrides.items())).replace("torch.", "").replace("/", "_")
        parent = Path(scratch) / f"llama-h{hidden}-l{layers}-m{max_len}{'-' + key if key else ''}"
        done = parent / "done"
        if done.exists():
            return Path(done.read_text())
        parent.mkdir(parents=True, exist_ok=True)
    else:
        parent, done = Path(tempfile.mkdtemp(prefix=prefix)), None
    import torch

    from tests.helpers.tiny_models import make_tiny_model

    if isinstance(overrides.get("dtype"), str):
        overrides["dtype"] = getattr(torch, overrides["dtype"])
    heads = hidden // 64
    folder = make_tiny_model(
        parent, arch="llama", hidden_size=hidden, intermediate_size=hidden * 3,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
        vocab_size=32000, max_position_embeddings=max_len, **overrides,
    )
    if done is not None:
        done.write_text(str(folder))  # written last: a part killed while writing leaves no half model to reuse
    return folder
