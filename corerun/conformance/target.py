"""What a suite runs against: a registered implementation (by name) or an unregistered factory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from corerun.plugin.capabilities import (
    AttentionCapabilities,
    ExecutorCapabilities,
    GraphRunnerCapabilities,
    KVCacheCapabilities,
    LogitsProcessorCapabilities,
    ModelCapabilities,
    QuantizationCapabilities,
    SamplerCapabilities,
)
from corerun.protocols.fused_ops import FusedOpsCapabilities
from corerun.protocols.lora import LoRAKernelCapabilities
from corerun.tool_parsers.protocol import ReasoningParserCapabilities, ToolParserCapabilities


def default_capabilities(kind: str) -> Any:
    """What an implementation that declares nothing is assumed to support."""
    if kind == "attention":
        return AttentionCapabilities()
    if kind == "kv_cache":
        return KVCacheCapabilities()
    if kind == "graph":
        return GraphRunnerCapabilities()
    if kind == "sampler":
        return SamplerCapabilities(params=frozenset())
    if kind == "logits_processor":
        return LogitsProcessorCapabilities(params=frozenset({"structured_outputs"}))
    if kind == "tool_parser":
        return ToolParserCapabilities(formats=frozenset({"hermes"}))
    if kind == "reasoning_parser":
        return ReasoningParserCapabilities()
    if kind == "model":
        return ModelCapabilities()
    if kind == "quantization":
        return QuantizationCapabilities()
    if kind == "lora":
        return LoRAKernelCapabilities()
    if kind == "executor":
        return ExecutorCapabilities()
    if kind == "fused_ops":
        return FusedOpsCapabilities()
    raise ValueError(f"unknown implementation kind {kind!r}; kinds are attention, kv_cache, graph, sampler, "
                     "logits_processor, tool_parser, reasoning_parser, model, quantization, lora, executor, fused_ops")


@dataclass
class Target:
    """One implementation under test.

    ``registration`` is the registry entry of a named implementation (``factory`` is then ``None``);
    an unregistered implementation gives ``factory`` and ``capabilities`` directly.  ``options`` are
    handed to the factory (validated by the plugin's options schema when registered).
    """

    kind: str
    name: str
    capabilities: Any
    factory: Callable[..., Any] | None = None
    registration: Any = None
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def registered(cls, kind: str, name: str, options: dict[str, Any] | None = None, capabilities: Any = None) -> "Target":
        """Look ``name`` up in the process-wide registry (errors list what is installed)."""
        from corerun.plugin.registry import get_registry

        reg = get_registry().get(kind, name)
        caps = capabilities or reg.capabilities or default_capabilities(kind)
        return cls(kind=kind, name=name, capabilities=caps, registration=reg, options=dict(options or {}))

    @classmethod
    def from_factory(
        cls, kind: str, factory: Callable[..., Any], capabilities: Any = None, name: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> "Target":
        """An unregistered implementation; capabilities default to ``factory.capabilities`` when it has one."""
        caps = capabilities or getattr(factory, "capabilities", None) or default_capabilities(kind)
        label = name or getattr(factory, "name", None) or getattr(factory, "__name__", "custom")
        return cls(kind=kind, name=str(label), capabilities=caps, factory=factory, options=dict(options or {}))

    def unavailable_reasons(self) -> list[str]:
        """Every reason this implementation cannot run here (the registry probe); empty when it can."""
        if self.registration is None:
            return []
        return list(self.registration.unavailable_reasons())

    def create(self, *args: Any, **kwargs: Any) -> Any:
        """Build the implementation with the kind's factory signature (plus ``options``)."""
        if self.registration is not None:
            return self.registration.create(*args, options=self.options, **kwargs)
        assert self.factory is not None
        return self.factory(*args, **kwargs, **self.options)

    def implementation_class(self) -> Any:
        """The factory itself: the class a model family or a parser registered (imported now)."""
        if self.factory is not None:
            return self.factory
        from corerun.plugin.registry import resolve

        return resolve(self.registration.factory)

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.name}"
