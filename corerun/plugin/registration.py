"""One implementation a plugin registered: its declaration, and probing, importing and building it.

Nothing here imports torch or a kernel library; factories and probes are resolved only when used.
"""

from __future__ import annotations

import difflib
import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from corerun._version import PROTOCOL_VERSION
from corerun.errors import CorerunError, PluginError, PluginUnavailableError
from corerun.plugin import hookspecs, trust

logger = logging.getLogger("corerun.registry")


class PluginLoadError(PluginError):
    """Importing or building a plugin's implementation raised; names the plugin, its distribution and
    the original exception (chained as ``__cause__``).  ``import_failure``: the exception was an
    ImportError (a kernel module that cannot be imported), so no build of it can succeed."""

    def __init__(self, message: str, import_failure: bool = False) -> None:
        super().__init__(message)
        self.import_failure = import_failure

ENTRY_POINT_GROUP = "corerun"
ENV_ALLOW_LIST = "CORERUN_PLUGINS"
KINDS = tuple(hookspecs.HOOKS)
KIND_TITLES = {
    "attention": "attention backend", "kv_cache": "KV-cache manager", "graph": "graph runner", "sampler": "sampler",
    "logits_processor": "logits processor", "tool_parser": "tool-call parser", "reasoning_parser": "reasoning parser",
    "model": "model family", "quantization": "quantization method", "lora": "LoRA kernel", "executor": "executor",
    "fused_ops": "fused-ops implementation",
}

BUILTIN_MODULE = "corerun.plugin.builtin"

# Names this project publishes, so an unknown name can come with the pip command that provides it.
KNOWN_DISTRIBUTIONS: dict[tuple[str, str], str] = {
    ("attention", "flash"): "corerun-attention-flash",
    ("attention", "triton"): "corerun-attention-triton",
    ("sampler", "basic"): "corerun-sampler-basic",
    ("logits_processor", "xgrammar"): "corerun-structured-output",
}


def resolve(ref: str | Callable[..., Any]) -> Callable[..., Any]:
    """``"package.module:attr"`` -> the object (imported now); callables pass through."""
    if callable(ref):
        return ref
    module, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


@dataclass
class Registration:
    """One implementation a plugin registered."""

    kind: str
    name: str
    factory: str | Callable[..., Any]
    plugin: str  # entry-point name (or "corerun" for built-ins)
    distribution: str
    version: str
    capabilities: Any = None
    probe: str | Callable[[], list[str]] | None = None
    options: Any = None  # pydantic model class
    protocol_version: int = PROTOCOL_VERSION
    priority: int | dict[str, int] = 0  # or per device type: {"cuda": 10, "cpu": -10}
    description: str = ""
    origin: str = trust.THIRD_PARTY  # built-in, first-party or third-party (corerun.plugin.trust)
    _reasons: list[str] | None = field(default=None, repr=False)
    _import_reasons: list[str] | None = field(default=None, repr=False)

    def priority_on(self, device_type: str) -> int:
        """The priority ``auto`` uses on a device type."""
        if isinstance(self.priority, dict):
            return int(self.priority.get(device_type, self.priority.get("default", 0)))
        return int(self.priority)

    @property
    def builtin(self) -> bool:
        return self.origin == trust.BUILTIN

    @property
    def title(self) -> str:
        """``attention backend 'mine' (plugin 'mine', distribution corerun-attention-mine 0.4.0)``."""
        return f"{KIND_TITLES[self.kind]} '{self.name}' (plugin '{self.plugin}', distribution {self.distribution} {self.version})"

    def trust_problem(self, device_type: str) -> str | None:
        """``None`` when ``auto`` may choose this implementation on ``device_type``; else why not."""
        if self.origin in (trust.BUILTIN, trust.FIRST_PARTY):
            return None
        problem = trust.certificate_problem(self, device_type)
        return None if problem is None else f"third-party, {problem}"

    def trust_label(self, device_type: str) -> str:
        if self.origin != trust.THIRD_PARTY:
            return self.origin
        return "certified" if trust.certificate_problem(self, device_type) is None else "not certified"

    def probe_reasons(self) -> list[str]:
        """Every reason the probe gives for not running here (empty when it can). Runs the probe once."""
        if self._reasons is None:
            if self.probe is None:
                self._reasons = []
            else:
                try:
                    self._reasons = list(resolve(self.probe)())
                except Exception as exc:  # a probe that crashes makes its plugin unavailable, not the CLI
                    self._reasons = [f"availability probe raised {type(exc).__name__}: {exc}"]
        return self._reasons

    def import_reasons(self) -> list[str]:
        """``[]`` when the factory's module imports (tried once); else why not."""
        if self._import_reasons is None:
            self._import_reasons = []
            if isinstance(self.factory, str):
                try:
                    resolve(self.factory)
                except Exception as exc:
                    self._import_reasons = [f"import of {self.factory} failed: {type(exc).__name__}: {exc}"]
        return self._import_reasons

    def unavailable_reasons(self) -> list[str]:
        """Every reason this implementation cannot run here (empty when it can): the probe's, else an
        import of the factory's module that fails."""
        return self.probe_reasons() or self.import_reasons()

    @property
    def available(self) -> bool:
        return not self.unavailable_reasons()

    def validate_options(self, options: dict[str, Any], where: str) -> dict[str, Any]:
        if not options:
            return {}
        if self.options is None:
            raise PluginError(
                f"{where}: {KIND_TITLES[self.kind]} '{self.name}' takes no options, got {sorted(options)}"
            )
        from pydantic import ValidationError

        try:
            model = self.options.model_validate(options)
        except ValidationError as exc:
            fields = sorted(getattr(self.options, "model_fields", {}))
            details = "; ".join(
                f"{where}.options.{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e.get('input')!r})"
                + (_option_hint(str(e["loc"][-1]), fields) if e["type"] == "extra_forbidden" and e["loc"] else "")
                for e in exc.errors()
            )
            raise PluginError(f"invalid options for {KIND_TITLES[self.kind]} '{self.name}': {details}") from None
        return model.model_dump()

    def create(self, *args: Any, options: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """Build the implementation.  Raises PluginUnavailableError with every probe reason first; an
        exception while importing or building it becomes one PluginLoadError line naming the plugin,
        its distribution and the exception (corerun errors such as UnsupportedError pass as they are)."""
        reasons = self.unavailable_reasons()
        if reasons:
            raise PluginUnavailableError(KIND_TITLES[self.kind], self.name, reasons)
        opts = self.validate_options(options or {}, self.kind)
        try:
            return resolve(self.factory)(*args, **kwargs, **opts)
        except CorerunError:
            raise
        except Exception as exc:
            if isinstance(exc, ImportError):  # a kernel module imported lazily: unavailable from now on
                self._import_reasons = [f"import failed while building it: {type(exc).__name__}: {exc}"]
            logger.info("building %s failed", self.title, exc_info=True)
            raise PluginLoadError(
                f"{self.title} failed to load: {type(exc).__name__}: {exc} (corerun -v shows the traceback)",
                import_failure=isinstance(exc, ImportError),
            ) from exc

    def to_dict(self, with_availability: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {
            "kind": self.kind,
            "name": self.name,
            "plugin": self.plugin,
            "distribution": self.distribution,
            "version": self.version,
            "protocol_version": self.protocol_version,
            "priority": self.priority,
            "description": self.description,
            "origin": self.origin,
            "capabilities": self.capabilities.to_dict() if hasattr(self.capabilities, "to_dict") else None,
        }
        if with_availability:
            reasons = self.unavailable_reasons()
            d["available"] = not reasons
            d["reasons"] = reasons
        return d


def _option_hint(given: str, fields: list[str]) -> str:
    """`` (did you mean 'num_splits'?; options are ...)`` for an option name no field has."""
    close = difflib.get_close_matches(given, fields, n=1)
    return (f" (did you mean '{close[0]}'?" if close else " (") + f"{'; ' if close else ''}options are {', '.join(fields) or 'none'})"
