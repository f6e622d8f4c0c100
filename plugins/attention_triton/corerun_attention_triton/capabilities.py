"""What the ``triton`` backend supports, as plain data (imported at plugin-listing time: no torch, no triton)."""

from __future__ import annotations

from corerun import AttentionCapabilities

CAPABILITIES = AttentionCapabilities(
    dtypes=frozenset({"float16", "bfloat16", "float32"}),
    head_sizes=None,  # any head size up to max_head_size: tiles are masked to the next power of two
    max_head_size=256,
    block_sizes=frozenset({16, 32, 64, 128}),
    devices=frozenset({"cpu", "cuda"}),  # cuda: compiled kernels; cpu: Triton's interpreter
    gqa=True,
    cuda_graph_decode=True,
    emulated_on=frozenset({"cpu"}),  # Triton's interpreter: corerun warns when it is named on CPU
)
