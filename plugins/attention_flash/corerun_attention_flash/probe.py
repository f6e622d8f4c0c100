"""Availability probe: every reason flash-attn cannot run here."""

from __future__ import annotations

import importlib.util


def probe() -> list[str]:
    reasons: list[str] = []
    if importlib.util.find_spec("flash_attn") is None and importlib.util.find_spec("flash_attn_interface") is None:
        reasons.append(
            "flash-attn is not installed (pip install 'corerun-attention-flash[flash-attn]' or "
            "pip install flash-attn --no-build-isolation, on a machine with a CUDA build of torch)"
        )
    import torch

    if not torch.cuda.is_available():
        reasons.append("needs a CUDA device (torch.cuda.is_available() is False)")
    else:
        major, minor = torch.cuda.get_device_capability()
        if major < 8:
            reasons.append(f"needs compute capability 8.0 or newer (Ampere+), this GPU is {major}.{minor}")
    return reasons
