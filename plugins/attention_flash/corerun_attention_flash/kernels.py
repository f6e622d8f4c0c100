"""The flash-attn library the backend calls, chosen and imported once, at construction (never at listing time).

- FA3, ``flash_attn_interface`` (built from flash-attention's ``hopper/`` folder), on a Hopper GPU
  (compute capability 9.0) when it is importable and its ``flash_attn_with_kvcache`` reads a paged
  cache (``page_table``, ``cu_seqlens_q``).  FA3's ``flash_attn_varlen_func`` has no paged-cache
  argument, so prefill and mixed batches also go through ``flash_attn_with_kvcache``, with the
  queries packed back to back (``cu_seqlens_q``, ``max_seqlen_q``).  Any page size.
- FA2, ``flash_attn`` (``pip install flash-attn``), everywhere else: ``flash_attn_varlen_func`` with
  ``block_table`` for prefill and mixed batches, ``flash_attn_with_kvcache`` with ``block_table`` for
  decode.  Page sizes must be multiples of 256.

Both are called with ``causal=True``: flash-attn aligns the causal mask to the bottom-right corner,
so query ``j`` of a request with ``q`` new tokens and ``k`` keys sees keys ``0 .. k - q + j``, which is
exactly "its cached prefix plus its own tokens up to itself".
"""

from __future__ import annotations

import importlib
import inspect
import logging
from types import ModuleType
from typing import Any

import torch

from corerun.protocols.attention import AttentionSpec
from corerun_attention_flash import emulation
from corerun_attention_flash.capabilities import FA2_PAGE_MULTIPLE, FA3_COMPUTE_CAPABILITY, MIN_COMPUTE_CAPABILITY
from corerun_attention_flash.metadata import FlashDecodeMetadata, FlashVarlenMetadata
from corerun_attention_flash.probe import INSTALL_HINT

logger = logging.getLogger("corerun_attention_flash")


class FA2Kernels:
    """flash-attn 2 (``flash_attn``): varlen prefill and kvcache decode over a paged cache."""

    page_multiple = FA2_PAGE_MULTIPLE

    def __init__(self, module: ModuleType) -> None:
        self.library = f"flash_attn {getattr(module, '__version__', '(unknown version)')} (FA2)"
        self._varlen = module.flash_attn_varlen_func
        self._with_kvcache = module.flash_attn_with_kvcache

    def varlen(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, m: FlashVarlenMetadata, scale: float) -> torch.Tensor:
        """``q`` ``[num_tokens, H, D]``; caches ``[num_blocks, block_size, Hkv, D]`` -> ``[num_tokens, H, D]``."""
        return self._varlen(
            q, k_cache, v_cache,
            cu_seqlens_q=m.cu_seqlens_q, cu_seqlens_k=m.cu_seqlens_k,
            max_seqlen_q=m.max_seqlen_q, max_seqlen_k=m.max_seqlen_k,
            softmax_scale=scale, causal=True, block_table=m.block_table,
        )

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, m: FlashDecodeMetadata, scale: float) -> torch.Tensor:
        """``q`` ``[num_reqs, 1, H, D]`` -> ``[num_reqs, 1, H, D]``."""
        return self._with_kvcache(
            q, k_cache, v_cache,
            cache_seqlens=m.cache_seqlens, block_table=m.block_table,
            softmax_scale=scale, causal=True,
        )


class FA3Kernels:
    """flash-attn 3 (``flash_attn_interface``, Hopper): ``flash_attn_with_kvcache`` for every batch."""

    page_multiple = 1

    def __init__(self, module: ModuleType) -> None:
        self.library = f"flash_attn_interface {_fa3_version(module)} (FA3)"
        self._with_kvcache = module.flash_attn_with_kvcache

    def varlen(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, m: FlashVarlenMetadata, scale: float) -> torch.Tensor:
        """``q`` ``[num_tokens, H, D]`` packed by ``cu_seqlens_q`` -> ``[num_tokens, H, D]``."""
        return self._with_kvcache(
            q, k_cache, v_cache,
            cache_seqlens=m.seq_lens, page_table=m.block_table,
            cu_seqlens_q=m.cu_seqlens_q, max_seqlen_q=m.max_seqlen_q,
            softmax_scale=scale, causal=True,
        )

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, m: FlashDecodeMetadata, scale: float) -> torch.Tensor:
        """``q`` ``[num_reqs, 1, H, D]`` -> ``[num_reqs, 1, H, D]``."""
        return self._with_kvcache(
            q, k_cache, v_cache,
            cache_seqlens=m.cache_seqlens, page_table=m.block_table,
            softmax_scale=scale, causal=True,
        )


FlashKernels = FA2Kernels | FA3Kernels

NOT_INSTALLED = "is not installed"
FA2_PARAMS = {"flash_attn_varlen_func": ("block_table",), "flash_attn_with_kvcache": ("cache_seqlens", "block_table")}
FA3_PARAMS = {"flash_attn_with_kvcache": ("cache_seqlens", "page_table", "cu_seqlens_q", "max_seqlen_q")}


def _fa3_version(module: ModuleType) -> str:
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    from importlib import metadata

    for dist in ("flash_attn_3", "flash-attn-3", "flashattn-hopper"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "(unknown version)"


def _import(name: str) -> tuple[ModuleType | None, str]:
    """The module, or ``None`` and why not: "is not installed" or "is installed but failed to import (...)"."""
    try:
        return importlib.import_module(name), ""
    except ModuleNotFoundError as exc:
        if exc.name == name:
            return None, NOT_INSTALLED
        return None, f"is installed but failed to import ({exc})"
    except Exception as exc:  # an extension built against another torch: undefined symbol, OSError...
        return None, f"is installed but failed to import ({type(exc).__name__}: {exc}; rebuild it against this torch)"


def _missing(module: ModuleType, wanted: dict[str, tuple[str, ...]]) -> list[str]:
    missing: list[str] = []
    for func_name, params in wanted.items():
        func: Any = getattr(module, func_name, None)
        if func is None:
            missing.append(f"{func_name}()")
            continue
        try:
            have = inspect.signature(func).parameters
        except (TypeError, ValueError):
            continue  # not introspectable: let the construction self-check decide
        missing += [f"{func_name}({p}=...)" for p in params if p not in have]
    return missing


def is_hopper(device: torch.device) -> bool:
    emulated = emulation.current()
    if emulated is not None:
        return emulated.hopper
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) == FA3_COMPUTE_CAPABILITY


def load_kernels(device: torch.device) -> tuple[FlashKernels | None, list[str]]:
    """The flash-attn library to use on ``device``, or ``None`` and every reason none can be used."""
    fa3_note = ""
    if is_hopper(device):
        module, why = _import("flash_attn_interface")
        if module is not None:
            missing = _missing(module, FA3_PARAMS)
            if not missing:
                return FA3Kernels(module), []
            why = f"lacks {', '.join(missing)} (upgrade FA3)"
        fa3_note = f"; flash_attn_interface (FA3) {why}"
    module, why = _import("flash_attn")
    if module is None:
        hint = f" ({INSTALL_HINT})" if why == NOT_INSTALLED else ""
        return None, [f"flash-attn {why}{hint}{fa3_note}"]
    missing = _missing(module, FA2_PARAMS)
    if missing:
        version = getattr(module, "__version__", "?")
        return None, [f"flash-attn {version} is too old: it lacks {', '.join(missing)}; corerun needs flash-attn >= 2.6{fa3_note}"]
    if fa3_note:
        logger.info("flash attention uses FA2%s", fa3_note)
    return FA2Kernels(module), []


def device_reasons(device: torch.device) -> list[str]:
    """Why flash-attn cannot run on ``device`` (only CUDA devices are judged here; the capabilities judge the type)."""
    if device.type != "cuda" or emulation.current() is not None:
        return []
    if not torch.cuda.is_available():
        return ["needs a CUDA device (torch.cuda.is_available() is False)"]
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_COMPUTE_CAPABILITY:
        need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
        return [f"needs compute capability {need} or newer (Ampere+), {device} is {cap[0]}.{cap[1]}"]
    return []


def installed_limit_reasons(kernels: FlashKernels, spec: AttentionSpec) -> list[str]:
    """Limits of the installed library beyond the static declaration (today: FA2's page-size rule)."""
    multiple = kernels.page_multiple
    if spec.block_size % multiple:
        fit = -(-spec.block_size // multiple) * multiple
        return [
            f"{kernels.library} reads a paged KV cache only in blocks of a multiple of {multiple} tokens, "
            f"got kv_cache.block_size {spec.block_size}; use kv_cache.block_size {fit}"
            + (" (or FA3, flash_attn_interface, on a Hopper GPU)" if isinstance(kernels, FA2Kernels) else "")
        ]
    return []
