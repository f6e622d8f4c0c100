"""Discovery: the implementations the built-ins and the installed ``corerun`` entry points register,
by kind and name, through pluggy.

Each entry point loads on its own: one that fails to import, registers a name twice, or implements
another protocol version is recorded with its error and the rest keep working.  Listing plugins
imports no torch or kernel library; factories and probes are resolved only when used.  Choosing among
what was found is :mod:`corerun.plugin.selection`'s job.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import logging
import os
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import pluggy

from corerun._version import PROTOCOL_VERSION, __version__
from corerun.errors import PluginError, PluginNotFoundError, ProtocolVersionError
from corerun.plugin import hookspecs, trust
from corerun.plugin.registration import (
    BUILTIN_MODULE, ENTRY_POINT_GROUP, ENV_ALLOW_LIST, KIND_TITLES, KINDS, KNOWN_DISTRIBUTIONS, PluginLoadError,
    Registration, resolve,
)
from corerun.plugin.selection import Selection, announce, as_configured, auto_ranking, choose_auto, misfits

# Names importers reach through this module (tests, the CLI, the conformance runner).
__all__ = [
    "BUILTIN_MODULE", "ENTRY_POINT_GROUP", "ENV_ALLOW_LIST", "KINDS", "KIND_TITLES", "LoadError", "PluginLoadError",
    "Registration", "Registry", "Selection", "announce", "get_registry", "misfits", "resolve",
]

logger = logging.getLogger("corerun.registry")


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
        self.allow_list: list[str] | None = None  # the CORERUN_PLUGINS ids, when set
        self.filter_warnings: list[str] = []

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
        allowed = None if allow is None else list(dict.fromkeys(allow))
        self.allow_list = allowed
        installed = sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
        for ep in installed:
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
        ids = sorted({ep.name for ep in installed})
        for entry in allowed or ():
            if entry in ids:
                continue
            msg = (
                f"{ENV_ALLOW_LIST} names '{entry}', but no installed plugin has that id; it lists plugin ids "
                f"(entry-point names), not implementation names. Installed plugin ids: {', '.join(ids) or 'none'}"
            )
            close = difflib.get_close_matches(entry, ids, n=1)
            if close:
                msg += f". Did you mean '{close[0]}'?"
            self.filter_warnings.append(msg)
            logger.warning("%s", msg)

    def register_module(
        self, module: Any, *, plugin: str, distribution: str, version: str, origin: str | None = None
    ) -> None:
        """Register one plugin object (a module or any object with hook implementations) and collect what
        it provides.  ``origin`` (built-in, first-party, third-party) defaults to what :mod:`corerun.plugin.trust`
        derives from the plugin id and distribution."""
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
        origin = origin or trust.origin(plugin, distribution)
        for kind, hook_name in hookspecs.HOOKS.items():
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.plugin_name != plugin:
                    continue
                register = self._register_callback(kind, plugin, distribution, version, origin)
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

    def _register_callback(self, kind: str, plugin: str, distribution: str, version: str, origin: str) -> Callable[..., None]:
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
                priority=priority, description=description, origin=origin,
            )
            self._add(reg)

        return register

    def _add(self, reg: Registration) -> None:
        """Add ``reg``; a name taken twice is kept by the higher origin (built-in, then first-party), and
        a tie leaves the name to nobody, each refusal a load error naming both distributions."""
        kind, name = reg.kind, reg.name
        table, key = self.registrations[kind], (reg.kind, reg.name)
        holders = self.duplicates.get(key) or ([table[name]] if name in table else [])
        if not holders:
            table[name] = reg
            return
        top = max(trust.RANK[h.origin] for h in holders)
        if trust.RANK[reg.origin] < top:
            self._refuse(reg, next(h for h in holders if trust.RANK[h.origin] == top))
        elif trust.RANK[reg.origin] > top:
            if key in self.duplicates:  # the tie it ends is no longer an error of its own
                stale = self._duplicate_message(key)
                self.load_errors = [e for e in self.load_errors if e.error != stale]
                del self.duplicates[key]
            table[name] = reg
            for holder in holders:
                self._refuse(holder, reg)
        else:
            if key not in self.duplicates:
                table.pop(name)
                self.duplicates[key] = list(holders)
            self.duplicates[key].append(reg)
            self.load_errors.append(LoadError(reg.plugin, reg.distribution, self._duplicate_message(key)))

    def _refuse(self, refused: Registration, keeper: Registration) -> None:
        self.load_errors.append(LoadError(refused.plugin, refused.distribution, (
            f"{KIND_TITLES[refused.kind]} name '{refused.name}' belongs to {keeper.distribution} ({keeper.origin}); "
            f"the one {refused.distribution} (plugin '{refused.plugin}') registers is ignored. {keeper.distribution} "
            f"keeps serving '{refused.name}'; to use the other, {refused.distribution} must register it under "
            f"another name (or pip uninstall {refused.distribution})"
        )))

    def _duplicate_message(self, key: tuple[str, str]) -> str:
        regs = self.duplicates[key]
        kind, name = key
        dists = " and ".join(f"{r.distribution} (plugin '{r.plugin}')" for r in regs)
        removes = " or ".join(f"`pip uninstall {r.distribution}`" for r in regs)
        keep_one = ",".join(r.plugin for r in regs[:1])
        return (
            f"{KIND_TITLES[kind]} name '{name}' is registered by both {dists}, so neither is used; remove one: "
            f"{removes} (or load only one, e.g. {ENV_ALLOW_LIST}={keep_one})"
        )

    # --------------------------------------------------------------- lookup
    def names(self, kind: str) -> list[str]:
        return sorted(self.registrations[kind])

    def all(self) -> list[Registration]:
        return [r for kind in KINDS for r in sorted(self.registrations[kind].values(), key=lambda r: r.name)]

    def get(self, kind: str, name: str) -> Registration:
        """The registration for ``name``; errors list what is installed, what failed to load, the active
        ``CORERUN_PLUGINS`` filter, and suggest a spelling and the pip command."""
        if kind not in self.registrations:
            raise PluginError(f"unknown plugin kind '{kind}'; kinds are {', '.join(KINDS)}")
        key = (kind, name)
        if key in self.duplicates:
            raise PluginError(self._duplicate_message(key))
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
            if self.allow_list is not None:
                msg += f" (and allow it in {ENV_ALLOW_LIST})"
        failed = [e for e in self.load_errors if not e.error.startswith(f"{KIND_TITLES[kind]} name ")]
        if failed:
            msg += " Plugins that failed to load: " + "; ".join(f"'{e.plugin}' ({e.distribution}): {e.error}" for e in failed) + "."
        if self.allow_list is not None:
            msg += (
                f" {ENV_ALLOW_LIST}={','.join(self.allow_list)} is set: only those plugin ids (and the built-ins) load"
            )
            if self.filter_warnings:
                msg += "; " + "; ".join(w.split(";")[0].removeprefix(f"{ENV_ALLOW_LIST} names ") for w in self.filter_warnings)
            msg += "."
        raise PluginNotFoundError(msg)

    def create(self, kind: str, name: str, *args: Any, options: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        return self.get(kind, name).create(*args, options=options, **kwargs)

    def check_names(self, config: Any) -> None:
        """Look up every implementation ``config`` names (not ``auto``) before anything is loaded, so a
        misspelt, duplicated or missing name fails at once, not after the model has loaded."""
        wanted = [
            ("attention", config.attention.name), ("sampler", config.sampler.name),
            ("kv_cache", config.kv_cache.manager.name), ("graph", config.graph.runner.name),
            ("fused_ops", config.fused_ops.name),
        ]
        for kind, name in wanted:
            if name != "auto":
                self.get(kind, name)

    # ------------------------------------------------------------ selection (corerun.plugin.selection)
    def auto_ranking(self, kind: str, need: Any) -> tuple[list[Registration], list[tuple[Registration, str]]]:
        """What ``auto`` considers for ``need``, best first, and every other one with why it was passed over
        (:func:`corerun.plugin.selection.auto_ranking`)."""
        return auto_ranking(self.registrations[kind].values(), need)

    def select(self, kind: str, name: str, need: Any, announce_as: str | None = None) -> Selection:
        """The implementation of ``kind`` to build: ``name`` itself (used as asked, never replaced; one
        that is unknown, unavailable or does not fit ``need`` raises with every reason), or for ``auto``
        the highest-priority available one that fits ``need`` among those ``auto`` may choose (built-in,
        first-party, certified).  The choice is announced on ``corerun.selection`` as ``announce_as``
        (default: the kind)."""
        label = announce_as or kind
        if name != "auto":
            return as_configured(self.get(kind, name), need, label)
        return choose_auto(kind, self.registrations[kind].values(), need, label)

    def select_attention(self, name: str, spec: Any) -> Registration:
        """The attention backend for the model's AttentionSpec (see :meth:`select`)."""
        return self.select("attention", name, spec).registration

_default: Registry | None = None


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry, loaded from the environment on first use."""
    global _default
    if _default is None or refresh:
        _default = Registry.from_environment()
    return _default
