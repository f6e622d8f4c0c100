"""Entry point of corerun-attention-cpu: registers the ``cpu`` attention backend and the ``cpu`` fused ops
(imports no torch, compiles nothing)."""

from corerun import hookimpl

from corerun_attention_cpu.capabilities import CPU_CAPABILITIES, FUSED_OPS_CAPABILITIES


@hookimpl
def corerun_attention_backends(register):
    register(
        "cpu",
        "corerun_attention_cpu.backend:CpuAttentionBackend",
        capabilities=CPU_CAPABILITIES,
        probe="corerun_attention_cpu.probe:probe",
        # above the torch reference (0) on CPU, so `attention: auto` takes it there when it is available
        priority={"cpu": 20, "default": -10},
        description=(
            "C++ paged attention on CPU: walks each sequence's block table with an online softmax "
            "(no gather of the context), vectorised, OpenMP over sequences x KV heads"
        ),
    )


@hookimpl
def corerun_fused_ops(register):
    register(
        "cpu",
        "corerun_attention_cpu.fused_ops:CpuFusedOps",
        capabilities=FUSED_OPS_CAPABILITIES,
        probe="corerun_attention_cpu.probe:probe",  # the same library: built, or the reasons it cannot be
        priority={"cpu": 20, "default": -10},  # above the torch reference (0) on CPU, as the attention backend
        description="C++ RMSNorm, SiLU-and-mul and RoPE on CPU: one pass each, float32 math rounded once, strided rows",
    )
