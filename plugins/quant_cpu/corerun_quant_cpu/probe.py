"""Availability probes: build (or find already built) the kernel library and return every reason a method cannot run."""

from __future__ import annotations


def probe() -> list[str]:
    """Reasons ``gguf_cpu`` cannot run here (no compiler or ninja, a failed build); empty when it can."""
    from corerun_quant_cpu import kernels

    return kernels.load()


def probe_dense() -> list[str]:
    """Reasons ``dense_cpu`` cannot run here: those of :func:`probe`, or a CPU without AVX512_BF16 (where
    the kernel widens bfloat16 to float32 and oneDNN's product, ``none``'s, is the one to keep)."""
    from corerun_quant_cpu import kernels

    reasons = kernels.load()
    if not reasons and kernels.bf16_best_isa() not in kernels.BF16_NATIVE:
        reasons = [f"this CPU lacks AVX512_BF16 (the bfloat16 kernel would run {kernels.bf16_best_isa()!r}); "
                   "quantization: none multiplies bfloat16 with oneDNN"]
    return reasons


def probe_w8a8() -> list[str]:
    """Reasons ``compressed_tensors_cpu`` cannot run here: those of :func:`probe`, or a CPU with neither AMX-INT8
    (granted by the kernel) nor AVX-512 VNNI, where the built-in's exact float product is the one to keep."""
    from corerun_quant_cpu import kernels

    reasons = kernels.load()
    if not reasons and not kernels.int8_amx_available() and not kernels.int8_vnni_available():
        reasons = ["this CPU has neither AMX-INT8 (granted by Linux) nor AVX-512 VNNI; "
                   "quantization: compressed-tensors multiplies W8A8 with its own exact product"]
    return reasons


def probe_w4() -> list[str]:
    """Reasons ``gptq_cpu`` / ``awq_cpu`` cannot run here: those of :func:`probe` (without AVX-512 VNNI and VBMI they
    run, decoding in C++ for every call and multiplying in torch: still ahead of the built-in's decode)."""
    from corerun_quant_cpu import kernels

    return kernels.load()
