"""What the ``triton`` backend supports, as plain data (imported at plugin-listing time: no torch, no triton)."""

from __future__ import annotations

from corerun import AttentionCapabilities
from corerun.sdk import LoRAKernelCapabilities

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

LORA_CAPABILITIES = LoRAKernelCapabilities(
    devices=frozenset({"cpu", "cuda"}),  # cuda: compiled kernels; cpu: Triton's interpreter
    dtypes=frozenset({"float16", "bfloat16", "float32"}),
    max_rank=128,  # the shrunk rows are one tile of up to 128 columns
    graph_safe=True,  # grids from shapes only; slot counts and order computed on the device
    grouped=True,
)
