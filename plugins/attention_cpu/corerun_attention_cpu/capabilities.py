"""What the ``cpu`` backend and the ``cpu`` fused ops declare, as plain data (imported at plugin-listing
time: no torch).

The kernel takes any head size up to 256 (its per-thread buffers are sized for that), any block
size, GQA/MQA with any group size, per-layer sliding windows and logit soft-capping, and keeps
float32 accumulators for every dtype.  float64 is left
to the ``torch`` reference backend.  Quantized KV caches (fp8 e4m3 / e5m2 with per-tensor scales, int8 with a
scale per token-head) are dequantized block by block inside the kernel.
"""

from __future__ import annotations

from corerun.sdk import AttentionCapabilities, FusedOpsCapabilities

MAX_HEAD_SIZE = 256  # MAX_HEAD_SIZE in csrc/paged_attention.cpp

CPU_CAPABILITIES = AttentionCapabilities(
    dtypes=frozenset({"float32", "bfloat16", "float16"}),
    head_sizes=None,
    max_head_size=MAX_HEAD_SIZE,
    block_sizes=None,
    devices=frozenset({"cpu"}),
    gqa=True,
    cuda_graph_decode=False,
    replay_decode=True,  # backend.py's C calls go through corerun.protocols.replay.native; plan keeps the batch's tensors
    sliding_window=True,
    logits_soft_cap=True,
    kv_cache_dtypes=frozenset({"fp8_e4m3", "fp8_e5m2", "int8"}),
)

# csrc/fused_ops.cpp: RMSNorm, SiLU-and-mul and RoPE in float32 and bfloat16 (float16 is left to torch)
FUSED_OPS_CAPABILITIES = FusedOpsCapabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"float32", "bfloat16"}))
