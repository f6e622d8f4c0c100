"""The built-in ``torch`` backend's capabilities, as data importable without torch (the registry lists them)."""

from __future__ import annotations

from corerun.plugin.capabilities import AttentionCapabilities

CAPABILITIES = AttentionCapabilities(
    dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
    devices=frozenset({"cpu", "cuda"}),
    gqa=True,
    cuda_graph_decode=True,
    sliding_window=True,
    logits_soft_cap=True,
    kv_cache_dtypes=frozenset({"fp8_e4m3", "fp8_e5m2", "int8"}),
)
