"""Exceptions raised by corerun. Every message says what was wrong, the value, and what would be right."""

from __future__ import annotations


class CorerunError(Exception):
    """Base class of every error corerun raises on purpose."""


class ConfigError(CorerunError, ValueError):
    """A configuration value is wrong (names the field, the value, and what is allowed)."""


class UnsupportedError(CorerunError, NotImplementedError):
    """An implementation was asked for something it did not declare (dtype, head size, sampling parameter...).

    Implementations raise this instead of computing garbage; the conformance suite checks they do.
    """

    def __init__(self, implementation: str, reasons: list[str] | str):
        self.implementation = implementation
        self.reasons = [reasons] if isinstance(reasons, str) else list(reasons)
        super().__init__(f"{implementation}: " + "; ".join(self.reasons))


class PluginError(CorerunError):
    """A plugin could not be loaded, registered twice, or does not exist."""


class PluginNotFoundError(PluginError, LookupError):
    """No installed plugin provides the requested name."""


class PluginUnavailableError(PluginError):
    """The plugin is installed, but cannot run here (its probe gave the reasons)."""

    def __init__(self, kind: str, name: str, reasons: list[str]):
        self.kind, self.name, self.reasons = kind, name, list(reasons)
        lines = "\n".join(f"  - {r}" for r in self.reasons)
        super().__init__(f"{kind} '{name}' is installed but unavailable:\n{lines}")


class ProtocolVersionError(PluginError):
    """A plugin implements a different corerun protocol version than this core."""


class RequestError(CorerunError, ValueError):
    """A request (prompt or sampling parameters) cannot be served; other requests are unaffected."""


class StepError(CorerunError):
    """A plugin raised inside an engine step; the step's requests end with this error."""


class EngineClosedError(CorerunError, RuntimeError):
    """A request was made to an engine after ``shutdown()``."""
