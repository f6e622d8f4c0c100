"""Finds installed implementations through pluggy and the ``corerun`` entry-point group, and selects among them.

Each entry point loads on its own: one that fails to import, registers a name twice, or implements
another protocol version is recorded with its error and the rest keep working.  Listing plugins
imports no torch or kernel library; factories and probes are resolved only when used.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import logging
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import pluggy

from corerun import hookspecs
from corerun._version import PROTOCOL_VERSION, __version__
from corerun.errors import PluginError, PluginNotFoundError, PluginUnavailableError, ProtocolVersionError

logger = logging.getLogger("corerun.registry")

ENTRY_POINT_GROUP = "corerun"
ENV_ALLOW_LIST = "CORERUN_PLUGINS"
KINDS = tuple(hookspecs.HOOKS)
KIND_TITLES = {"attention": "attention backend", "kv_cache": "KV-cache manager", "graph": "graph runner", "sampler": "sampler"}
BUILTIN_MODULE = "corerun.builtin_plugins"

# Names this project publishes, so an unknown name can come with the pip command that provides it.
KNOWN_DISTRIBUTIONS: dict[tuple[str, str], str] = {
    ("attention", "flash"): "corerun-attention-flash",
    ("attention", "triton"): "corerun-attention-triton",
    ("sampler", "basic"): "corerun-sampler-basic",
    ("sampler", "full"): "corerun-sampler-full",
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
    _reasons: list[str] | None = field(default=None, repr=False)

    def priority_on(self, device_type: str) -> int:
        """The priority ``auto`` uses on a device type."""
        if isinstance(self.priority, dict):
            return int(self.priority.get(device_type, self.priority.get("default", 0)))
        return int(self.priority)

    @property
    def builtin(self) -> bool:
        return self.plugin == "corerun"

    def unavailable_reasons(self) -> list[str]:
        """Every reason this implementation cannot run here (empty when it can). Runs the probe once."""
        if self._reasons is None:
            if self.probe is None:
                self._reasons = []
            else:
                try:
                    self._reasons = list(resolve(self.probe)())
                except Exception as exc:  # a probe that crashes makes its plugin unavailable, not the CLI
                    self._reasons = [f"availability probe raised {type(exc).__name__}: {exc}"]
        return self._reasons

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
            details = "; ".join(
                f"{where}.options.{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e.get('input')!r})" for e in exc.errors()
            )
            raise PluginError(f"invalid options for {KIND_TITLES[self.kind]} '{self.name}': {details}") from None
        return model.model_dump()

    def create(self, *args: Any, options: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """Build the implementation. Raises PluginUnavailableError with every probe reason first."""
        reasons = self.unavailable_reasons()
        if reasons:
            raise PluginUnavailableError(KIND_TITLES[self.kind], self.name, reasons)
        opts = self.validate_options(options or {}, self.kind)
        return resolve(self.factory)(*args, **kwargs, **opts)

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
            "capabilities": self.capabilities.to_dict() if hasattr(self.capabilities, "to_dict") else None,
        }
        if with_availability:
            reasons = self.unavailable_reasons()
            d["available"] = not reasons
            d["reasons"] = reasons
        return d


@dataclass
class LoadError:
    plugin: str
    distribution: str
    error: str
    detail: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"plugin": self.plugin, "distribution": self.distribution, "error": self.error}


class Registry:
    """Every implementation the installed plugins provide, by kind and name."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("corerun")
        self.pm.add_hookspecs(hookspecs)
        self.registrations: dict[str, dict[str, Registration]] = {k: {} for k in KINDS}
        self.load_errors: list[LoadError] = []
        self.duplicates: dict[tuple[str, str], list[Registration]] = {}
        self.plugins: dict[str, tuple[str, str]] = {}  # plugin id -> (distribution, version)

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_environment(cls, allow: Iterable[str] | None = None) -> "Registry":
        """Built-ins plus the installed entry points (only those named in ``CORERUN_PLUGINS`` when it is set)."""
        reg = cls()
        reg.register_module(importlib.import_module(BUILTIN_MODULE), plugin="corerun", distribution="corerun", version=__version__)
        if allow is None:
            env = os.environ.get(ENV_ALLOW_LIST)
            allow = None if env is None else [p.strip() for p in env.split(",") if p.strip()]
        reg.load_entry_points(allow)
        return reg

    def load_entry_points(self, allow: Iterable[str] | None = None) -> None:
        allowed = None if allow is None else set(allow)
        for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if allowed is not None and ep.name not in allowed:
                continue
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            try:
                module = ep.load()
            except Exception as exc:
                self.load_errors.append(
                    LoadError(ep.name, dist, f"import of {ep.value} failed: {type(exc).__name__}: {exc}", traceback.format_exc())
                )
                logger.warning("plugin %s (%s) failed to load: %s", ep.name, dist, exc)
                continue
            self.register_module(module, plugin=ep.name, distribution=dist, version=version)
        self.pm.check_pending()

    def register_module(self, module: Any, *, plugin: str, distribution: str, version: str) -> None:
        """Register one plugin object (a module or any object with hook implementations) and collect what it provides."""
        if plugin in self.plugins:
            other = self.plugins[plugin][0]
            self.load_errors.append(
                LoadError(plugin, distribution, f"plugin id '{plugin}' is already used by distribution {other}")
            )
            return
        try:
            self.pm.register(module, name=plugin)
        except Exception as exc:
            self.load_errors.append(LoadError(plugin, distribution, f"{type(exc).__name__}: {exc}"))
            return
        problem = self._hook_problem(module)
        if problem:  # reported for this plugin alone, instead of check_pending() failing every plugin
            self.pm.unregister(module)
            self.load_errors.append(LoadError(plugin, distribution, problem))
            return
        self.plugins[plugin] = (distribution, version)
        for kind, hook_name in hookspecs.HOOKS.items():
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.plugin_name != plugin:
                    continue
                register = self._register_callback(kind, plugin, distribution, version)
                kwargs = {"register": register}
                try:
                    impl.function(**{k: v for k, v in kwargs.items() if k in impl.argnames})
                except Exception as exc:
                    self.load_errors.append(
                        LoadError(plugin, distribution, f"hook {hook_name} raised {type(exc).__name__}: {exc}", traceback.format_exc())
                    )

    def _hook_problem(self, module: Any) -> str:
        """Why ``module`` cannot be used: hook implementations no spec matches, or hooks left unmarked."""
        hooks = list(hookspecs.HOOKS.values())
        unknown = [
            hc.name for hc in self.pm.get_hookcallers(module) or []
            if not hc.has_spec() and any(not i.optionalhook for i in hc.get_hookimpls() if i.plugin is module)
        ]
        if unknown:
            hints = [
                f"'{n}'" + (f" (did you mean '{close[0]}'?)" if (close := difflib.get_close_matches(n, hooks, n=1)) else "")
                for n in sorted(unknown)
            ]
            return f"implements unknown hook(s) {', '.join(hints)}; corerun's hooks are {', '.join(hooks)}"
        unmarked = [n for n in hooks if callable(getattr(module, n, None)) and self.pm.parse_hookimpl_opts(module, n) is None]
        if unmarked:
            return f"defines {', '.join(unmarked)} without the @corerun.hookimpl decorator, so corerun would never call it"
        return ""

    def _register_callback(self, kind: str, plugin: str, distribution: str, version: str) -> Callable[..., None]:
        def register(
            name: str,
            factory: str | Callable[..., Any],
            *,
            capabilities: Any = None,
            probe: str | Callable[[], list[str]] | None = None,
            options: Any = None,
            protocol_version: int = PROTOCOL_VERSION,
            priority: int | dict[str, int] = 0,
            description: str = "",
        ) -> None:
            if protocol_version != PROTOCOL_VERSION:
                raise ProtocolVersionError(
                    f"{KIND_TITLES[kind]} '{name}' from {distribution} implements corerun protocol version "
                    f"{protocol_version}, but this corerun {__version__} implements version {PROTOCOL_VERSION}; "
                    f"upgrade {distribution if protocol_version < PROTOCOL_VERSION else 'corerun'}"
                )
            reg = Registration(
                kind=kind, name=name, factory=factory, plugin=plugin, distribution=distribution, version=version,
                capabilities=capabilities, probe=probe, options=options, protocol_version=protocol_version,
                priority=priority, description=description,
            )
            table = self.registrations[kind]
            key = (kind, name)
            if key in self.duplicates:
                self.duplicates[key].append(reg)
            elif name in table:
                first = table.pop(name)
                self.duplicates[key] = [first, reg]
            else:
                table[name] = reg
                return
            dists = " and ".join(f"{r.distribution} (plugin '{r.plugin}')" for r in self.duplicates[key])
            self.load_errors.append(
                LoadError(plugin, distribution, f"{KIND_TITLES[kind]} name '{name}' is registered by both {dists}")
            )

        return register

    # --------------------------------------------------------------- lookup
    def names(self, kind: str) -> list[str]:
        return sorted(self.registrations[kind])

    def all(self) -> list[Registration]:
        return [r for kind in KINDS for r in sorted(self.registrations[kind].values(), key=lambda r: r.name)]

    def get(self, kind: str, name: str) -> Registration:
        """The registration for ``name``; errors list what is installed, suggest a spelling and the pip command."""
        if kind not in self.registrations:
            raise PluginError(f"unknown plugin kind '{kind}'; kinds are {', '.join(KINDS)}")
        key = (kind, name)
        if key in self.duplicates:
            dists = " and ".join(f"{r.distribution} (plugin '{r.plugin}')" for r in self.duplicates[key])
            raise PluginError(
                f"{KIND_TITLES[kind]} name '{name}' is registered by both {dists}; uninstall one of them "
                f"or restrict loading with {ENV_ALLOW_LIST}"
            )
        table = self.registrations[kind]
        if name in table:
            return table[name]
        installed = ", ".join(f"{n} ({r.distribution})" for n, r in sorted(table.items())) or "none"
        msg = f"no {KIND_TITLES[kind]} named '{name}'. Installed: {installed}."
        candidates = {*table, *(n for (k, n) in KNOWN_DISTRIBUTIONS if k == kind)} - {name}
        close = difflib.get_close_matches(name, sorted(candidates), n=1)
        if close:
            msg += f" Did you mean '{close[0]}'?"
        hinted = name if key in KNOWN_DISTRIBUTIONS else close[0] if close and close[0] not in table else None
        dist = KNOWN_DISTRIBUTIONS.get((kind, hinted)) if hinted else None
        if dist:
            msg += f" '{hinted}' is provided by {dist}: pip install {dist}"
            if os.environ.get(ENV_ALLOW_LIST) is not None:
                msg += f" (and allow it in {ENV_ALLOW_LIST})"
        failed = [e for e in self.load_errors if e.plugin == name or name in e.error]
        for e in failed:
            msg += f" Plugin '{e.plugin}' ({e.distribution}) failed to load: {e.error}"
        raise PluginNotFoundError(msg)

    def create(self, kind: str, name: str, *args: Any, options: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        return self.get(kind, name).create(*args, options=options, **kwargs)

    def select_attention(self, name: str, spec: Any) -> Registration:
        """The attention backend for ``spec``: ``name`` itself (never replaced), or the best capable one for ``auto``."""
        if name != "auto":
            reg = self.get("attention", name)
            reasons = reg.unavailable_reasons() + (reg.capabilities.check(spec) if reg.capabilities else [])
            if reasons:
                raise PluginUnavailableError(KIND_TITLES["attention"], name, reasons)
            return reg
        rejected: list[str] = []
        candidates: list[Registration] = []
        for reg in self.registrations["attention"].values():
            reasons = reg.unavailable_reasons() + (reg.capabilities.check(spec) if reg.capabilities else [])
            if reasons:
                rejected.append(f"{reg.name}: " + "; ".join(reasons))
            else:
                candidates.append(reg)
        if not candidates:
            raise PluginUnavailableError(KIND_TITLES["attention"], "auto", rejected or ["no attention backend is installed"])
        dev = getattr(spec.device, "type", str(spec.device))
        best = max(candidates, key=lambda r: (r.priority_on(dev), r.name))
        others = ", ".join(f"{r.name} (priority {r.priority_on(dev)})" for r in candidates if r is not best)
        logger.info(
            "attention: auto chose '%s' (priority %d on %s)%s%s", best.name, best.priority_on(dev), dev,
            f"; also capable: {others}" if others else "",
            f"; not capable: {' | '.join(rejected)}" if rejected else "",
        )
        return best


_default: Registry | None = None


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry, loaded from the environment on first use."""
    global _default
    if _default is None or refresh:
        _default = Registry.from_environment()
    return _default
