"""Entry point of corerun-attention-cpu: registers the ``cpu`` backend (imports no torch, compiles nothing)."""

from corerun import hookimpl

from corerun_attention_cpu.capabilities import CPU_CAPABILITIES


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
