"""Capability checks every implementation must make: refuse what it did not declare, naming it."""

from __future__ import annotations

from typing import Any

from corerun.errors import UnsupportedError


def require_spec(who: str, capabilities: Any, spec: Any) -> None:
    """Raise :class:`UnsupportedError` with every reason ``spec`` (an ``AttentionSpec``) lies outside
    ``capabilities`` (an ``AttentionCapabilities``).  ``who`` names the implementation, e.g.
    ``"attention backend 'mine'"``.  Call it first thing in the factory."""
    reasons = capabilities.check(spec)
    if reasons:
        raise UnsupportedError(who, reasons)


def require_params(who: str, capabilities: Any, params: Any) -> None:
    """Raise :class:`UnsupportedError` naming every ``SamplingParams`` field set away from its no-op
    value that ``capabilities`` (a ``SamplerCapabilities``) does not declare: a sampler's ``check``."""
    missing = capabilities.check(params)
    if missing:
        raise UnsupportedError(who, [f"{name}={getattr(params, name)!r} is not supported" for name in missing])
