"""The plugin hooks. One hook per kind of implementation, each handed a ``register`` callback.

A plugin module implements any of them with ``@corerun.hookimpl`` and is exposed through an entry
point in the group ``corerun`` (the entry-point name is the plugin's id).  ``register`` takes::

    register(
        name,                      # the short name users select, e.g. "triton"
        factory,                   # "package.module:attr" (imported lazily) or a callable
        *,
        capabilities=None,         # AttentionCapabilities / SamplerCapabilities / ... (plain data)
        probe=None,                # "module:attr" or callable () -> list[str]: reasons it cannot run here
        options=None,              # a pydantic model validating the user's `options:` for this name
        protocol_version=PROTOCOL_VERSION,
        priority=0,                # `auto` prefers higher priorities among capable, available, trusted ones
        description="",
    )

Importing a plugin's entry-point module must not import torch, triton or any kernel library: the
factory and probe strings are only resolved when the implementation is used or its availability is
asked.  A hook may accept fewer arguments than the spec passes (pluggy's argument-subset rule), so
specs can grow without breaking plugins.
"""

from __future__ import annotations

from typing import Callable

import pluggy

hookspec = pluggy.HookspecMarker("corerun")
hookimpl = pluggy.HookimplMarker("corerun")

Register = Callable[..., None]


@hookspec
def corerun_attention_backends(register: Register) -> None:
    """Register attention backends: ``register(name, factory, capabilities=AttentionCapabilities(...), ...)``.

    The factory is called as ``factory(spec: AttentionSpec, **options)``.
    """


@hookspec
def corerun_kv_cache_managers(register: Register) -> None:
    """Register KV-cache managers: ``register(name, factory, capabilities=KVCacheCapabilities(...), ...)``.

    The factory is called as ``factory(num_blocks, block_size, *, prefix_caching, **options)``.
    """


@hookspec
def corerun_graph_runners(register: Register) -> None:
    """Register graph runners: ``register(name, factory, capabilities=GraphRunnerCapabilities(...), ...)``.

    The factory is called as ``factory(model, attention, limits, **options)``.
    """


@hookspec
def corerun_samplers(register: Register) -> None:
    """Register samplers: ``register(name, factory, capabilities=SamplerCapabilities(params=...), ...)``.

    The factory is called as ``factory(vocab_size, device, **options)``.
    """


@hookspec
def corerun_logits_processors(register: Register) -> None:
    """Register logits processors: ``register(name, factory, capabilities=LogitsProcessorCapabilities(params=...), ...)``.

    The factory is called as ``factory(vocab_size, device, *, tokenizer, eos_token_ids, **options)``.
    """


@hookspec
def corerun_tool_parsers(register: Register) -> None:
    """Register tool-call parsers: ``register(name, factory, capabilities=ToolParserCapabilities(formats=...), ...)``.

    The factory is called as ``factory(**options)`` and returns a ``corerun.tool_parsers.ToolParser``.
    """


@hookspec
def corerun_reasoning_parsers(register: Register) -> None:
    """Register reasoning parsers: ``register(name, factory, capabilities=ReasoningParserCapabilities(...), ...)``.

    The factory is called as ``factory(**options)`` and returns a ``corerun.tool_parsers.ReasoningParser``.
    """


@hookspec
def corerun_models(register: Register) -> None:
    """Register model families: ``register(ARCHITECTURE, factory, capabilities=ModelCapabilities(...), ...)``.

    The name is an ``architectures`` entry of a ``config.json`` (``"LlamaForCausalLM"``); the factory is
    the model class, called as ``factory(config: ModelConfig)`` or ``factory(config, tp=group)``.
    """


@hookspec
def corerun_quantization_methods(register: Register) -> None:
    """Register quantization methods: ``register(name, factory, capabilities=QuantizationCapabilities(...), ...)``.

    The factory is called as ``factory(**options)`` and returns a ``corerun.quantization.QuantizationMethod``.
    """


@hookspec
def corerun_executors(register: Register) -> None:
    """Register executors: ``register(name, factory, capabilities=ExecutorCapabilities(...), ...)``.

    The factory is called as ``factory(**options)`` (``distributed.executor_options``) and returns a
    ``corerun.protocols.executor.Executor``: it starts and drives the ranks of a placement.
    """


@hookspec
def corerun_lora_kernels(register: Register) -> None:
    """Register LoRA kernels: ``register(name, factory, capabilities=LoRAKernelCapabilities(...), ...)``.

    The factory is called as ``factory(**options)`` (``lora.kernel``'s options) and returns a
    ``corerun.protocols.lora.LoRAKernel``: it adds each token's adapter to a targeted layer's output.
    """


@hookspec
def corerun_fused_ops(register: Register) -> None:
    """Register fused elementwise ops: ``register(name, factory, capabilities=FusedOpsCapabilities(...), ...)``.

    The factory is called as ``factory(**options)`` (``fused_ops``' options) and returns a
    ``corerun.protocols.fused_ops.FusedOps``: RMSNorm, SiLU-and-mul and RoPE, one call each.
    """


HOOKS: dict[str, str] = {
    "attention": "corerun_attention_backends",
    "kv_cache": "corerun_kv_cache_managers",
    "graph": "corerun_graph_runners",
    "sampler": "corerun_samplers",
    "logits_processor": "corerun_logits_processors",
    "tool_parser": "corerun_tool_parsers",
    "reasoning_parser": "corerun_reasoning_parsers",
    "model": "corerun_models",
    "quantization": "corerun_quantization_methods",
    "lora": "corerun_lora_kernels",
    "fused_ops": "corerun_fused_ops",
    "executor": "corerun_executors",
}

__all__ = ["hookspec", "hookimpl", "HOOKS", "Register"]


