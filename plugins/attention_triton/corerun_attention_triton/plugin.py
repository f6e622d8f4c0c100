"""Entry point of corerun-attention-triton: registers the ``triton`` backend (imports no torch or triton)."""

from __future__ import annotations

from typing import Any

from corerun import hookimpl

from corerun_attention_triton.capabilities import CAPABILITIES


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
