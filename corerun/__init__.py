"""corerun: the model-runner core of an LLM inference engine, made pluggable.

Public API::

    from corerun import LLM, SamplingParams

Plugin authors use ``corerun.hookimpl``, the capability classes and the protocols in
``corerun.protocols``.  Importing ``corerun`` itself imports no torch: heavy names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from corerun.platform.host import prepare_openmp

prepare_openmp()  # before torch loads OpenMP: idle threads spin a fraction of a millisecond, then sleep (corerun.platform.host)

from corerun._version import PROTOCOL_VERSION, __version__
from corerun.plugin.capabilities import (
    AttentionCapabilities,
    GraphRunnerCapabilities,
    KVCacheCapabilities,
    LogitsProcessorCapabilities,
    SamplerCapabilities,
)
from corerun.errors import (
    ConfigError,
    CorerunError,
    PluginError,
    PluginNotFoundError,
    PluginUnavailableError,
    RequestError,
    UnsupportedError,
)
from corerun.plugin.hookspecs import hookimpl

_LAZY = {
    "LLM": "corerun.llm",
    "CompletionOutput": "corerun.outputs",
    "RequestOutput": "corerun.outputs",
    "Logprob": "corerun.outputs",
    "SamplingParams": "corerun.sampling_params",
    "LoRARequest": "corerun.lora.request",
    "StructuredOutputsParams": "corerun.sampling_params",
    "Config": "corerun.config",
    "load_config": "corerun.config",
    "get_registry": "corerun.plugin.registry",
}

if TYPE_CHECKING:  # pragma: no cover
    from corerun.config import Config, load_config
    from corerun.llm import LLM
    from corerun.lora.request import LoRARequest
    from corerun.outputs import CompletionOutput, Logprob, RequestOutput
    from corerun.plugin.registry import get_registry
    from corerun.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'corerun' has no attribute {name!r}")


__all__ = [
    "__version__",
    "PROTOCOL_VERSION",
    "hookimpl",
    "AttentionCapabilities",
    "GraphRunnerCapabilities",
    "KVCacheCapabilities",
    "LogitsProcessorCapabilities",
    "SamplerCapabilities",
    "ConfigError",
    "CorerunError",
    "PluginError",
    "PluginNotFoundError",
    "PluginUnavailableError",
    "RequestError",
    "UnsupportedError",
    *_LAZY,
]
