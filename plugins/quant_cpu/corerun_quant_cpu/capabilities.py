"""What the ``gguf_cpu`` and ``dense_cpu`` methods declare, as plain data (imported at plugin-listing time: no torch).

``gguf_cpu`` reads every GGUF type the built-in ``gguf`` method reads; Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K shards go
through the C++ products for batches of up to ``KERNEL_MAX_TOKENS`` rows and through the C++ decoders plus torch's
matmul above that; every other type (F16, BF16, F32) through ``gguf``'s own decode-and-multiply.  CPU only.  On a CPU
with AVX-512 and VNNI the product quantizes the activations to int8 per 32-value block, as llama.cpp
does (``int8_activations``: the conformance bound adds half an activation step).

``dense_cpu`` reads unquantized checkpoints, as the built-in ``none`` does, for a model run in bfloat16 or float32
on CPU: bfloat16 batches of up to ``BF16_MAX_TOKENS`` rows (``BF16_AMX_MAX_TOKENS`` where the CPU has AMX) go
through the C++ bfloat16 product, float32 ones of up to ``F32_MAX_TOKENS`` through the C++ float32 product, larger
ones through oneDNN's prepacked product.

``compressed_tensors_cpu`` reads what the built-in ``compressed-tensors`` reads, CPU only; its W8A8 layers
with per-token activations multiply every batch on AMX-INT8 tiles or with AVX-512 VNNI, its W4A16 layers
(``pack-quantized``) batches of up to 32 rows (16 in bfloat16) with AVX-512 VNNI.  ``gptq_cpu`` and ``awq_cpu`` read what the
built-in ``gptq`` and ``awq`` read, CPU only, their 4-bit layers multiplied as ``compressed_tensors_cpu``'s W4A16
ones.  The 4-bit products quantize the activations to int8 per 32-value block (``int8_activations``).
"""

from __future__ import annotations

from dataclasses import replace

from corerun.sdk import AWQ_CAPABILITIES as AWQ
from corerun.sdk import COMPRESSED_TENSORS_CAPABILITIES as COMPRESSED_TENSORS
from corerun.sdk import GGUF_CAPABILITIES as GGUF
from corerun.sdk import GPTQ_CAPABILITIES as GPTQ
from corerun.sdk import QuantizationCapabilities

KERNEL_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"})  # kernels.TYPES and kernels.K_TYPES
KERNEL_MAX_TOKENS = 16  # above: decoded once per call, torch's matmul (faster from here on: benchmarks/RESULTS.md)
# above: oneDNN's prepacked bfloat16 product (benchmarks/bf16_gemv_bench.py --model). Than the AMX tiles it is as
# fast from about 64 (a 128-token step: 65 against 46 ms; with amx_tiles.h's blocked loop for many tokens 40.9
# against 37.5, and a 128-request decode step no faster with 128 here). On a CPU without AMX, oneDNN multiplies on
# AVX512_BF16 too and the kernel is ahead to 16 tokens (an AMD EPYC, 269 MB of weights, one thread: 8 tokens 16.4
# against 21.4 ms, 16 level at 30.4; two threads 10.6 / 15.6 at 8, 17.4 / 19.0 at 16; benchmarks/RESULTS.md,
# "Seventeenth session"). 4 had been measured on a Sapphire Rapids, against oneDNN on AMX tiles.
BF16_MAX_TOKENS = 16
BF16_AMX_MAX_TOKENS = 64
# above: oneDNN's prepacked float32 product. The default model's 538 MB of float32 weights (benchmarks/f32_gemv_bench.py,
# an AMD EPYC whose memory gives one thread 26 GB/s and two 33; ms per step, kernel / oneDNN): one thread 21.7 / 38.0
# at 1 token, 33.7 / 41.7 at 8, 44.7 / 45.1 at 12, 56.2 / 53.7 at 16; two threads 16.5 / 23.5 at 1, 19.0 / 23.5 at
# 8, 22.9 / 26.3 at 12, 29.7 / 30.8 at 16 (benchmarks/RESULTS.md, "Nineteenth session").
F32_MAX_TOKENS = 12

# the AVX-512 path quantizes activations to int8 per 32-block (llama.cpp's way); scalar and AVX2 do not
GGUF_CPU = replace(GGUF, devices=frozenset({"cpu"}), int8_activations=True)
# W8A8 quantizes activations per token, the 4-bit products per 32-block: the suite's bound adds the step to every format
COMPRESSED_TENSORS_CPU = replace(COMPRESSED_TENSORS, devices=frozenset({"cpu"}), int8_activations=True)
GPTQ_CPU = replace(GPTQ, devices=frozenset({"cpu"}), int8_activations=True)
AWQ_CPU = replace(AWQ, devices=frozenset({"cpu"}), int8_activations=True)
DENSE_CPU = QuantizationCapabilities(
    dense=True, bits=frozenset({16.0, 32.0}), activation_dtypes=frozenset({"bfloat16", "float32"}), devices=frozenset({"cpu"}),
    compiles=False,  # its C++ ops and oneDNN's packed weights do not lower in inductor: graph.runner compile keeps none
)
