"""The built-in methods' capabilities, as data importable without torch (the registry lists them)."""

from __future__ import annotations

from corerun.plugin.capabilities import QuantizationCapabilities

# the GGML types corerun reads (corerun.quantization.gguf_blocks.LAYOUTS, checked equal in the tests)
GGUF_TYPES = frozenset({"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"})

DENSE = QuantizationCapabilities(
    dense=True, gguf_types=GGUF_TYPES, bits=frozenset({16.0, 32.0}),
    activation_dtypes=frozenset({"float32", "bfloat16", "float16", "float64"}),
)
GGUF = QuantizationCapabilities(
    gguf_types=GGUF_TYPES,
    bits=frozenset({4.5, 5.0, 5.5, 6.5625, 8.5, 16.0, 32.0}),  # bits per value, scales included
    group_sizes=frozenset({32, 256}),
    zero_point=True,  # Q4_1's minimum, Q4_K / Q5_K's sub-block minimums
    activation_dtypes=frozenset({"float32", "bfloat16", "float16", "float64"}),
)

_FLOATS = frozenset({"float32", "bfloat16", "float16"})
GPTQ = QuantizationCapabilities(
    quant_methods=frozenset({"gptq"}), bits=frozenset({4.0, 8.0}), group_sizes=frozenset({-1, 32, 64, 128}),
    zero_point=True, activation_dtypes=_FLOATS,
)
AWQ = QuantizationCapabilities(
    quant_methods=frozenset({"awq"}), bits=frozenset({4.0}), group_sizes=frozenset({32, 64, 128}),
    zero_point=True, activation_dtypes=_FLOATS,
)
COMPRESSED_TENSORS = QuantizationCapabilities(  # pack-quantized W4A16, int-quantized W8A8 / W8A16, float-quantized FP8
    quant_methods=frozenset({"compressed-tensors"}), bits=frozenset({4.0, 8.0}), group_sizes=frozenset({32, 64, 128}),
    zero_point=True, activation_dtypes=_FLOATS,
)
FP8 = QuantizationCapabilities(quant_methods=frozenset({"fp8"}), bits=frozenset({8.0}), activation_dtypes=_FLOATS)
