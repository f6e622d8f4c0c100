"""Entry point of corerun-quant-cpu: registers the ``gguf_cpu``, ``dense_cpu``, ``compressed_tensors_cpu``, ``gptq_cpu``
and ``awq_cpu`` methods (imports no torch, compiles nothing)."""

from corerun import hookimpl

from corerun_quant_cpu.capabilities import AWQ_CPU, COMPRESSED_TENSORS_CPU, DENSE_CPU, GGUF_CPU, GPTQ_CPU


@hookimpl
def corerun_quantization_methods(register):
    register(
        "gguf_cpu",
        "corerun_quant_cpu.method:GGUFCpuMethod",
        capabilities=GGUF_CPU,
        probe="corerun_quant_cpu.probe:probe",
        # above the built-in gguf (10), so `quantization: auto` takes it for a .gguf file on CPU when it builds
        priority={"cpu": 20, "default": -10},
        description=(
            "GGUF blocks kept packed; Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K products of up to 16 tokens, the LM head "
            "included, in C++ straight from the blocks (AVX-512 VNNI with int8 activations, AVX2 or scalar, chosen at "
            "run time), the float types decoded per call as gguf does"
        ),
    )
    register(
        "dense_cpu",
        "corerun_quant_cpu.dense_method:DenseCpuMethod",
        capabilities=DENSE_CPU,
        probe="corerun_quant_cpu.probe:probe_dense",
        # above the built-in none (0), so `quantization: auto` takes it for a dense checkpoint run in bfloat16 on a
        # CPU with AVX512_BF16; its capabilities refuse float32 and float16, which keep none
        priority={"cpu": 20, "default": -10},
        description=(
            "unquantized weights run in bfloat16 on CPU: products of up to 4 tokens, the LM head included, in C++ "
            "(AVX512_BF16 dot products on weights repacked 16 rows by 2 columns), larger ones through oneDNN"
        ),
    )
    register(
        "compressed_tensors_cpu",
        "corerun_quant_cpu.w8a8_method:CompressedTensorsCpuMethod",
        capabilities=COMPRESSED_TENSORS_CPU,
        probe="corerun_quant_cpu.probe:probe_w8a8",
        # above the built-in compressed-tensors (0), so `quantization: auto` takes it for such a folder on a CPU with
        # AMX-INT8 or AVX-512 VNNI
        priority={"cpu": 20, "default": -10},
        description=(
            "compressed-tensors checkpoints as the built-in reads them; W8A8 products of every batch with per-token "
            "activations in C++ on AMX-INT8 tiles or AVX-512 VNNI (activations quantized, multiplied and scaled in one call), "
            "W4A16 products of up to 32 tokens (16 in bfloat16) from the 4-bit codes on AVX-512 VNNI (int8 activations per 32 values)"
        ),
    )
    for name, cls, caps, what in (("gptq_cpu", "GptqCpuMethod", GPTQ_CPU, "GPTQ"), ("awq_cpu", "AwqCpuMethod", AWQ_CPU, "AWQ")):
        register(
            name,
            f"corerun_quant_cpu.w4_method:{cls}",
            capabilities=caps,
            probe="corerun_quant_cpu.probe:probe_w4",
            # above the built-in (0), so `quantization: auto` takes it for such a checkpoint on CPU where the library builds
            priority={"cpu": 20, "default": -10},
            description=(
                f"{what} checkpoints as the built-in reads them; 4-bit products of up to 32 tokens (16 in bfloat16) in C++ straight from the "
                "codes, repacked at load (AVX-512 VNNI, int8 activations per 32 values), larger ones decoded in C++ and multiplied by torch"
            ),
        )
