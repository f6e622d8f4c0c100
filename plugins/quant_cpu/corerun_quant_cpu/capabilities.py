"""What the ``gguf_cpu`` method declares, as plain data (imported at plugin-listing time: no torch).

It reads every GGUF type the built-in ``gguf`` method reads; Q8_0, Q4_0 and Q4_1 shards go through the
C++ product for batches of up to ``KERNEL_MAX_TOKENS`` rows and through the C++ decoder plus torch's
matmul above that; every other type through ``gguf``'s own decode-and-multiply.  CPU only.  On a CPU
with AVX-512 and VNNI the product quantizes the activations to int8 per 32-value block, as llama.cpp
does (``int8_activations``: the conformance bound adds half an activation step).
"""

from __future__ import annotations

from dataclasses import replace

from corerun.sdk import GGUF_CAPABILITIES as GGUF

KERNEL_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_1"})  # kernels.TYPES
KERNEL_MAX_TOKENS = 16  # above: decoded once per call, torch's matmul (faster from here on: benchmarks/RESULTS.md)

# the AVX-512 path quantizes activations to int8 per 32-block (llama.cpp's way); scalar and AVX2 do not
GGUF_CPU = replace(GGUF, devices=frozenset({"cpu"}), int8_activations=True)
