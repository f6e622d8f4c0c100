"""Entry point of corerun-quant-cpu: registers the ``gguf_cpu`` method (imports no torch, compiles nothing)."""

from corerun import hookimpl

from corerun_quant_cpu.capabilities import GGUF_CPU


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
            "GGUF blocks kept packed; Q8_0 / Q4_0 / Q4_1 products of up to 16 tokens, the LM head included, in C++ "
            "straight from the blocks (AVX-512 VNNI with int8 activations, AVX2 or scalar, chosen at run time), "
            "the rest decoded per call as gguf does"
        ),
    )
