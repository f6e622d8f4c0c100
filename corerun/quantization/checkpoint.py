"""What a checkpoint says of its own quantization, for ``quantization: auto`` and for refusals."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GGUF_MARKER = "corerun-gguf.json"  # in a folder made for a .gguf file: {"gguf": path}; weights come from there


@dataclass(frozen=True)
class CheckpointFormat:
    """``quant_method``: ``quantization_config.quant_method`` of ``config.json`` (``None``: absent);
    ``gguf_types``: the GGML types of a GGUF file's tensors (empty: not GGUF); ``device``: where the model runs;
    ``dtype``: the dtype it runs in, by name (``"bfloat16"``; ``None``: not known, not checked);
    ``compiled``: it runs under ``graph.runner: compile`` (torch.compile traces the layers' products)."""

    device: Any
    quant_method: str | None = None
    gguf_types: frozenset[str] = frozenset()
    dtype: str | None = None
    compiled: bool = False

    def describe(self) -> str:
        if self.gguf_types:
            return f"a GGUF file of tensor types {', '.join(sorted(self.gguf_types))}"
        if self.quant_method:
            return f"a checkpoint with quantization_config.quant_method {self.quant_method!r}"
        return "an unquantized checkpoint"


def gguf_file_of(model_dir: str | Path) -> Path | None:
    """The ``.gguf`` file a corerun GGUF folder stands for (``None``: an ordinary model folder)."""
    marker = Path(model_dir) / GGUF_MARKER
    if not marker.is_file():
        return None
    return Path(json.loads(marker.read_text(encoding="utf-8"))["gguf"])


def quantization_config(model_dir: str | Path) -> dict[str, Any] | None:
    """``config.json``'s ``quantization_config`` (``None``: absent, or no readable ``config.json``)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    quant = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return quant if isinstance(quant, dict) else None


def checkpoint_format(model_dir: str | Path, device: Any, dtype: str | None = None) -> CheckpointFormat:
    """Read ``model_dir``'s ``config.json`` (and GGUF file, if it stands for one); ``dtype`` is the model's, as run."""
    gguf = gguf_file_of(model_dir)
    if gguf is not None:
        from corerun.quantization.gguf_file import gguf_types

        return CheckpointFormat(device, gguf_types=gguf_types(gguf), dtype=dtype)
    quant = quantization_config(model_dir)
    method = quant.get("quant_method") if quant is not None else None
    return CheckpointFormat(device, quant_method=str(method) if method is not None else None, dtype=dtype)
