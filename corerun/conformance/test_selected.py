"""Collected by ``pytest --pyargs corerun.conformance --corerun-impl KIND:NAME``.

Each class checks the implementations ``--corerun-impl`` selects for its kind; without the option
every test is skipped with the reason.  ``corerun conformance KIND:NAME`` runs this same module
(:mod:`corerun.conformance.runner`).
"""

from typing import Any

from corerun.conformance.attention_suite import AttentionBackendSuite
from corerun.conformance.executor_suite import ExecutorSuite
from corerun.conformance.fused_ops_suite import FusedOpsSuite
from corerun.conformance.graph_suite import GraphRunnerSuite
from corerun.conformance.kv_cache_suite import KVCacheManagerSuite
from corerun.conformance.logits_processor_suite import LogitsProcessorSuite
from corerun.conformance.lora_suite import LoRAKernelSuite
from corerun.conformance.model_suite import ModelSuite
from corerun.conformance.quantization_suite import QuantizationSuite
from corerun.conformance.sampler_suite import SamplerSuite
from corerun.conformance.suite import FROM_OPTION
from corerun.conformance.tool_parser_suite import ReasoningParserSuite, ToolParserSuite


class TestAttentionBackend(AttentionBackendSuite):
    implementation = FROM_OPTION


class TestKVCacheManager(KVCacheManagerSuite):
    implementation = FROM_OPTION


class TestGraphRunner(GraphRunnerSuite):
    implementation = FROM_OPTION

    def pytest_generate_tests(self, metafunc: Any) -> None:
        """``--corerun-attention NAME``: the model of every case attends through that backend."""
        name = metafunc.config.getoption("corerun_attention", None)
        if name:
            self.attention_backend = name
        super().pytest_generate_tests(metafunc)


class TestSampler(SamplerSuite):
    implementation = FROM_OPTION


class TestLogitsProcessor(LogitsProcessorSuite):
    implementation = FROM_OPTION


class TestToolParser(ToolParserSuite):
    implementation = FROM_OPTION


class TestReasoningParser(ReasoningParserSuite):
    implementation = FROM_OPTION


class TestModel(ModelSuite):
    implementation = FROM_OPTION


class TestQuantization(QuantizationSuite):
    implementation = FROM_OPTION


class TestExecutor(ExecutorSuite):
    implementation = FROM_OPTION


class TestLoRAKernel(LoRAKernelSuite):
    implementation = FROM_OPTION


class TestFusedOps(FusedOpsSuite):
    implementation = FROM_OPTION
