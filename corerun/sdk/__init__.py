"""The public toolkit for plugin authors: the pieces every backend or sampler writes the same way.

- :mod:`corerun.sdk.attention`: the dense KV-cache layout (:class:`DenseKVCache`), a sync-free
  :func:`write_kv`, :class:`DenseAttentionBackend` (capability check, plan, KV write; an author writes
  only ``attend``), and :func:`reference_attention`, a plain-torch kernel to start from.
- :mod:`corerun.sdk.sampling`: per-request seeded generators (:func:`seeded_generator`,
  :func:`row_seed`, :func:`exponential_race`), host lists to device without a sync, and the logits check.
- :mod:`corerun.sdk.kv_cache` / :mod:`corerun.sdk.graph`: corerun's ``paged`` KV-cache manager and
  ``eager`` graph runner, as base classes to start a plugin from; :func:`corerun.sdk.graph.native`, through
  which a kernel's ``ctypes`` calls go so that the CPU's ``replay`` runner can record them.
- :mod:`corerun.sdk.quantization`: the built-in ``gguf`` method and its block decoder, to build a
  GGUF method on (``GGUF_CAPABILITIES``, what ``gguf`` declares, importable here without torch), and
  the built-in ``none``, ``compressed-tensors``, ``gptq`` and ``awq`` methods (``COMPRESSED_TENSORS_CAPABILITIES``,
  ``GPTQ_CAPABILITIES``, ``AWQ_CAPABILITIES``).
- :mod:`corerun.sdk.executor`: what an executor builds on (the protocol's types, ``run_rank``, the
  errors it raises, corerun's ``local`` executor as a base class).
- :func:`require_spec` / :func:`require_params`: raise :class:`corerun.UnsupportedError` for what
  the declared capabilities do not cover, as the protocols require.
- :class:`LoRARequest`: the adapter a request runs under (name, integer id, PEFT folder), as the
  engine's callers give it.
- :func:`cache_dir`: corerun's per-machine cache folder, where a plugin keeps what it builds once
  (compiled kernels) in a subfolder named after itself.
- The plugin system's public names: :func:`hookimpl` and ``Register`` (the hooks), the capability
  classes and :class:`Need` (what an implementation declares and must fit), :class:`Registry`,
  :class:`Registration` and :func:`get_registry` (register a plugin object in a test, or build an
  implementation by name: ``Registry.from_environment().create("attention", "torch", spec)``).

A plugin imports only corerun's public modules (docs/plugins.md, *What a plugin may import*).

Importing ``corerun.sdk`` imports no torch; its submodules do.
"""

from __future__ import annotations

from corerun.platform.host import cache_dir
from corerun.plugin.capabilities import (
    ENGINE_PARAMS,
    PROCESSOR_PARAMS,
    AttentionCapabilities,
    ExecutorCapabilities,
    FusedOpsCapabilities,
    GraphRunnerCapabilities,
    KVCacheCapabilities,
    LogitsProcessorCapabilities,
    LoRAKernelCapabilities,
    ModelCapabilities,
    Need,
    QuantizationCapabilities,
    SamplerCapabilities,
)
from corerun.lora.request import LoRARequest
from corerun.plugin.hookspecs import Register, hookimpl
from corerun.plugin.registry import Registration, Registry, get_registry, resolve
from corerun.quantization.capabilities import AWQ as AWQ_CAPABILITIES
from corerun.quantization.capabilities import COMPRESSED_TENSORS as COMPRESSED_TENSORS_CAPABILITIES
from corerun.quantization.capabilities import GGUF as GGUF_CAPABILITIES
from corerun.quantization.capabilities import GPTQ as GPTQ_CAPABILITIES
from corerun.sdk.checks import require_params, require_spec

__all__ = [
    "AWQ_CAPABILITIES", "COMPRESSED_TENSORS_CAPABILITIES", "ENGINE_PARAMS", "GGUF_CAPABILITIES", "GPTQ_CAPABILITIES", "PROCESSOR_PARAMS", "AttentionCapabilities", "ExecutorCapabilities", "FusedOpsCapabilities", "GraphRunnerCapabilities",
    "KVCacheCapabilities", "LoRAKernelCapabilities", "LoRARequest", "LogitsProcessorCapabilities", "ModelCapabilities", "Need", "QuantizationCapabilities", "Register",
    "Registration", "Registry", "SamplerCapabilities", "cache_dir", "get_registry", "hookimpl", "require_params",
    "require_spec", "resolve",
]
