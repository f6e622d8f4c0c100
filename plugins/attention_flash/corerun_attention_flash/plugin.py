"""Entry point of corerun-attention-flash: registers the ``flash`` backend (imports no torch or flash_attn)."""

from corerun import hookimpl

from corerun_attention_flash.capabilities import FLASH_CAPABILITIES


@hookimpl
def corerun_attention_backends(register):
    register(
        "flash",
        "corerun_attention_flash.backend:FlashAttentionBackend",
        capabilities=FLASH_CAPABILITIES,
        probe="corerun_attention_flash.probe:probe",
        priority=20,
        description=(
            "flash-attn over the paged cache: flash_attn_varlen_func (prefill, mixed) + "
            "flash_attn_with_kvcache (decode); FA3 (flash_attn_interface) on Hopper"
        ),
    )
