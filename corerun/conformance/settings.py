"""Run-wide switches of the conformance suite, shared by the pytest plugin, the runner and the CLI.

Plain Python (no torch, no pytest): the ``pytest11`` plugin imports it in every pytest session.
"""

from __future__ import annotations

import os

KINDS = ("attention", "kv_cache", "graph", "sampler", "logits_processor", "tool_parser", "reasoning_parser", "model",
         "quantization", "executor", "lora", "fused_ops")
KIND_ALIASES = {"kv-cache": "kv_cache", "kvcache": "kv_cache", "kv": "kv_cache", "graph_runner": "graph", "graph-runner": "graph",
                "logits-processor": "logits_processor", "processor": "logits_processor",
                "tool-parser": "tool_parser", "reasoning-parser": "reasoning_parser", "models": "model",
                "quant": "quantization", "quantization_method": "quantization", "executors": "executor",
                "lora_kernel": "lora", "lora-kernel": "lora", "fused-ops": "fused_ops"}

# A suite class with ``implementation = FROM_OPTION`` checks the implementations --corerun-impl names.
FROM_OPTION = "--corerun-impl"

ENV_FULL_MATRIX = "CORERUN_FULL_MATRIX"
ENV_DEVICE = "CORERUN_DEVICE"


def parse_impl(ref: str) -> tuple[str, str]:
    """``"attention:triton"`` -> ``("attention", "triton")``; errors say what a reference looks like."""
    kind, sep, name = ref.partition(":")
    kind = KIND_ALIASES.get(kind.strip().lower(), kind.strip().lower())
    name = name.strip()
    if not sep or not name or kind not in KINDS:
        raise ValueError(
            f"implementation reference {ref!r} is not KIND:NAME with KIND one of {', '.join(KINDS)} "
            "(for example attention:torch, sampler:full, kv_cache:paged, graph:eager)"
        )
    return kind, name


def parse_xfail(spec: str) -> tuple[str, str]:
    """``"decode[bf16-*]=reason"`` -> ``("decode[bf16-*]", "reason")``; a reason is required."""
    pattern, sep, reason = spec.partition("=")
    if not sep or not pattern.strip() or not reason.strip():
        raise ValueError(
            f"expected failure {spec!r} must be PATTERN=REASON with a non-empty reason, "
            "for example 'decode[bf16-*]=bf16 decode accumulates in bf16 (issue #12)'"
        )
    return pattern.strip(), reason.strip()


def parse_option(item: str) -> tuple[str, object]:
    """``"num_splits=4"`` -> ``("num_splits", 4)``: an implementation option, the value read as a YAML scalar."""
    import yaml

    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"an implementation option must be KEY=VALUE (e.g. num_splits=4), got {item!r}")
    try:
        return key.strip(), (yaml.safe_load(raw) if raw.strip() else "")
    except yaml.YAMLError as exc:
        raise ValueError(f"implementation option {item!r}: the value is not valid YAML: {exc}") from None


def env_full_matrix() -> bool:
    """``CORERUN_FULL_MATRIX=1`` asks for the full cross product of declared capabilities."""
    return os.environ.get(ENV_FULL_MATRIX, "").strip().lower() in ("1", "true", "yes", "on")


def env_device() -> str | None:
    """``CORERUN_DEVICE=cpu|cuda`` overrides the device the suite picks."""
    value = os.environ.get(ENV_DEVICE, "").strip()
    return value or None
