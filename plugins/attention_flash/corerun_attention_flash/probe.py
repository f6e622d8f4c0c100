"""Availability probe: every reason flash-attn cannot run here (imports torch, never flash_attn itself)."""

from __future__ import annotations

import importlib.util

from corerun_attention_flash.capabilities import FA3_COMPUTE_CAPABILITY, MIN_COMPUTE_CAPABILITY

INSTALL_HINT = (
    "pip install 'corerun-attention-flash[flash-attn]' --no-build-isolation, or "
    "pip install flash-attn --no-build-isolation, on a machine with a CUDA build of torch"
)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken parent package, or a sys.modules entry without a spec
        return False


def probe() -> list[str]:
    """Reasons the ``flash`` backend cannot run on this machine; empty when it can."""
    reasons: list[str] = []
    has_fa2 = _installed("flash_attn")
    has_fa3 = _installed("flash_attn_interface")
    if not has_fa2 and not has_fa3:
        reasons.append(f"flash-attn is not installed ({INSTALL_HINT})")

    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        reasons.append(f"needs a CUDA device (torch.cuda.is_available() is False; torch {torch.__version__} is {build})")
        return reasons
    cap = torch.cuda.get_device_capability()
    if cap < MIN_COMPUTE_CAPABILITY:
        need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
        reasons.append(f"needs compute capability {need} or newer (Ampere+), this GPU is {cap[0]}.{cap[1]}")
    elif has_fa3 and not has_fa2 and cap != FA3_COMPUTE_CAPABILITY:
        reasons.append(
            f"only flash_attn_interface (FA3) is installed, which corerun uses on Hopper (compute capability 9.0) "
            f"only; this GPU is {cap[0]}.{cap[1]}: pip install flash-attn --no-build-isolation"
        )
    return reasons
