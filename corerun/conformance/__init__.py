"""corerun's conformance suite: one umbrella pytest class per protocol; the CLI and ``run()`` run them through pytest.

Three ways in::

    corerun conformance attention:triton                           # the CLI (rich table or --json)
    pytest --pyargs corerun.conformance --corerun-impl attention:triton
    class TestMine(AttentionBackendSuite): implementation = "mine"   # in a plugin's own tests

Importing this package imports neither torch nor pytest (it is loaded by the ``pytest11`` plugin in
every pytest session); the suites load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "AttentionBackendSuite": "corerun.conformance.attention_suite",
    "KVCacheManagerSuite": "corerun.conformance.kv_cache_suite",
    "GraphRunnerSuite": "corerun.conformance.graph_suite",
    "SamplerSuite": "corerun.conformance.sampler_suite",
    "LogitsProcessorSuite": "corerun.conformance.logits_processor_suite",
    "ToolParserSuite": "corerun.conformance.tool_parser_suite",
    "ReasoningParserSuite": "corerun.conformance.tool_parser_suite",
    "Transcript": "corerun.conformance.tool_parser_suite",
    "ModelSuite": "corerun.conformance.model_suite",
    "QuantizationSuite": "corerun.conformance.quantization_suite",
    "LoRAKernelSuite": "corerun.conformance.lora_suite",
    "ExecutorSuite": "corerun.conformance.executor_suite",
    "FusedOpsSuite": "corerun.conformance.fused_ops_suite",
    "ConformanceSuite": "corerun.conformance.suite",
    "Case": "corerun.conformance.suite",
    "Target": "corerun.conformance.target",
    "CheckResult": "corerun.conformance.runner",
    "run": "corerun.conformance.runner",
}

if TYPE_CHECKING:  # pragma: no cover
    from corerun.conformance.attention_suite import AttentionBackendSuite
    from corerun.conformance.executor_suite import ExecutorSuite
    from corerun.conformance.fused_ops_suite import FusedOpsSuite
    from corerun.conformance.graph_suite import GraphRunnerSuite
    from corerun.conformance.kv_cache_suite import KVCacheManagerSuite
    from corerun.conformance.runner import CheckResult, run
    from corerun.conformance.logits_processor_suite import LogitsProcessorSuite
    from corerun.conformance.lora_suite import LoRAKernelSuite
    from corerun.conformance.model_suite import ModelSuite
    from corerun.conformance.quantization_suite import QuantizationSuite
    from corerun.conformance.sampler_suite import SamplerSuite
    from corerun.conformance.suite import Case, ConformanceSuite
    from corerun.conformance.target import Target
    from corerun.conformance.tool_parser_suite import ReasoningParserSuite, ToolParserSuite, Transcript


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'corerun.conformance' has no attribute {name!r}")


__all__ = list(_LAZY)
