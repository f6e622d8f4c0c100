"""The protocols corerun composes, and the data types that cross them.

``PROTOCOL_VERSION`` is bumped on any incompatible change; every plugin declares the version it
implements and the registry refuses a mismatch.
"""

from corerun._version import PROTOCOL_VERSION
from corerun.protocols.attention import (
    AttentionBackend,
    AttentionBatch,
    AttentionCapabilities,
    AttentionSpec,
    DTYPE_NAMES,
    dtype_name,
)
from corerun.protocols.graph import GraphLimits, GraphRunner, GraphStats, ModelInputs
from corerun.protocols.kv_cache import KVCacheManager, KVCacheStats
from corerun.protocols.logits_processor import LogitsProcessor, LogitsProcessorCapabilities
from corerun.protocols.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerCapabilities,
    SamplerOutput,
    SamplingMetadata,
)
from corerun.protocols.step_layout import STEP_FIELDS, StepField, StepLayout, StepTensors, model_inputs, requests_step


__all__ = [
    "PROTOCOL_VERSION",
    "AttentionBackend",
    "AttentionBatch",
    "AttentionCapabilities",
    "AttentionSpec",
    "DTYPE_NAMES",
    "dtype_name",
    "GraphLimits",
    "GraphRunner",
    "GraphStats",
    "ModelInputs",
    "KVCacheManager",
    "KVCacheStats",
    "LogitsProcessor",
    "LogitsProcessorCapabilities",
    "LogprobsTensors",
    "Sampler",
    "SamplerCapabilities",
    "SamplerOutput",
    "SamplingMetadata",
    "STEP_FIELDS",
    "StepField",
    "StepLayout",
    "StepTensors",
    "model_inputs",
    "requests_step",
]
