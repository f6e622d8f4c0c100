"""Entry point of corerun-attention-triton: registers the ``triton`` attention backend and the ``triton``
LoRA kernel (imports no torch or triton)."""

from __future__ import annotations

from typing import Any

from corerun import hookimpl

from corerun_attention_triton.capabilities import CAPABILITIES, LORA_CAPABILITIES


def _options_model() -> Any:
    """The pydantic model for ``options:`` (``None`` where pydantic is missing; the factory still checks its arguments)."""
    try:
        from corerun_attention_triton.options import TritonAttentionOptions
    except ImportError:
        return None
    return TritonAttentionOptions


@hookimpl
def corerun_attention_backends(register):
    register(
        "triton",
        "corerun_attention_triton.backend:TritonAttentionBackend",
        capabilities=CAPABILITIES,
        probe="corerun_attention_triton.probe:probe",
        options=_options_model(),
        priority={"cuda": 10, "cpu": -10},  # the interpreter on CPU is far slower than the torch reference
        description=(
            "Triton unified paged attention (prefill chunks + decodes in one launch), split-KV decode; "
            "compiled on CUDA, interpreted on CPU"
        ),
    )


@hookimpl
def corerun_lora_kernels(register):
    register(
        "triton",
        "corerun_attention_triton.lora:TritonLoRAKernel",
        capabilities=LORA_CAPABILITIES,
        probe="corerun_attention_triton.probe:probe",
        priority={"cuda": 10, "cpu": -10},  # the interpreter on CPU is far slower than the built-in kernels
        description="Triton shrink/expand over tokens grouped by slot (vLLM's form); graph safe; interpreted on CPU",
    )
