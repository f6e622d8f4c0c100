"""Entry point of corerun-attention-flash: registers the ``flash`` backend (imports no torch or flash_attn)."""

from corerun import AttentionCapabilities, hookimpl


@hookimpl
def corerun_attention_backends(register):
    register(
        "flash",
        "corerun_attention_flash.backend:FlashAttentionBackend",
        capabilities=AttentionCapabilities(
            dtypes=frozenset({"float16", "bfloat16"}),
            head_sizes=frozenset({32, 64, 96, 128, 160, 192, 224, 256}),
            block_sizes=frozenset({256, 512, 1024}),
            devices=frozenset({"cuda"}),
            gqa=True,
            cuda_graph_decode=True,
        ),
        probe="corerun_attention_flash.probe:probe",
        priority=20,
        description="flash-attn varlen prefill + flash_attn_with_kvcache decode over the paged cache",
    )
