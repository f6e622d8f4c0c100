"""Entry point of corerun-attention-triton: registers the ``triton`` backend (imports no torch or triton)."""

from corerun import AttentionCapabilities, hookimpl


@hookimpl
def corerun_attention_backends(register):
    register(
        "triton",
        "corerun_attention_triton.backend:TritonAttentionBackend",
        capabilities=AttentionCapabilities(
            dtypes=frozenset({"float16", "bfloat16", "float32"}),
            max_head_size=256,
            block_sizes=frozenset({16, 32, 64, 128}),
            devices=frozenset({"cpu", "cuda"}),
            gqa=True,
            cuda_graph_decode=True,
        ),
        probe="corerun_attention_triton.probe:probe",
        priority=10,
        description="Triton unified paged attention (prefill chunks + decodes in one launch), split-KV decode",
    )
