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

from corerun import hookspecs, trust
from corerun._version import PROTOCOL_VERSION, __version__
from corerun.errors import CorerunError, PluginError, PluginNotFoundError, PluginUnavailableError, ProtocolVersionError

logger = logging.getLogger("corerun.registry")
# What serves the user (the `auto` choice and why, an explicitly named backend) is said on every
# startup: this logger is at INFO whatever the root level, and prints on its own when nothing is set up.
selection_logger = logging.getLogger("corerun.selection")
selection_logger.setLevel(logging.INFO)


def announce(message: str, *args: Any) -> None:
    """Log ``message`` on ``corerun.selection`` (shown at the default log level; silence it with
    ``logging.getLogger("corerun.selection").setLevel(logging.WARNING)``)."""
    if not selection_logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("corerun: %(message)s"))
        selection_logger.addHandler(handler)
        selection_logger.propagate = False
    selection_logger.info(message, *args)


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
    "model": "model family", "quantization": "quantization method",
}
BUILTIN_MODULE = "corerun.builtin_plugins"

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
    origin: str = trust.THIRD_PARTY  # built-in, first-party or third-party (corerun.trust)
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
        it provides.  ``origin`` (built-in, first-party, third-party) defaults to what :mod:`corerun.trust`
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
        ]
        for kind, name in wanted:
            if name != "auto":
                self.get(kind, name)

    # ------------------------------------------------------------ selection
    def auto_ranking(self, kind: str, need: Any) -> tuple[list[Registration], list[tuple[Registration, str]]]:
        """What ``auto`` considers for ``need`` (a :class:`~corerun.capabilities.Need`, or the model's
        AttentionSpec for attention): the eligible implementations, best first (highest priority on the
        device type, then name), and every other one with why it was passed over (what its capabilities
        say of ``need``, availability, trust).  Only the winner's factory module is imported to check it
        imports (the next in line takes over when it does not)."""
        dev = _device_type(need.device)
        eligible: list[Registration] = []
        passed: list[tuple[Registration, str]] = []
        for reg in sorted(self.registrations[kind].values(), key=lambda r: r.name):
            reasons = misfits(reg, need, auto=True) + reg.probe_reasons()
            problem = None if reasons else reg.trust_problem(dev)
            if reasons or problem:
                passed.append((reg, problem or "; ".join(reasons)))
            else:
                eligible.append(reg)
        eligible.sort(key=lambda r: (-r.priority_on(dev), r.name))
        # the factory is imported for the winner only (importing every candidate's kernels costs seconds)
        while eligible and eligible[0].import_reasons():
            passed.append((eligible[0], "; ".join(eligible.pop(0).import_reasons())))
        best = eligible[0] if eligible else None
        for reg in eligible[1:]:
            mine, top = reg.priority_on(dev), best.priority_on(dev)
            why = f"lower priority ({mine} < {top})" if mine < top else f"same priority ({mine}) as '{best.name}', which comes first by name"
            passed.insert(0, (reg, why))
        return eligible, passed

    def select(self, kind: str, name: str, need: Any, announce_as: str | None = None) -> "Selection":
        """The implementation of ``kind`` to build: ``name`` itself (used as asked, never replaced; one
        that is unknown, unavailable or does not fit ``need`` raises with every reason), or for ``auto``
        the highest-priority available one that fits ``need`` among those ``auto`` may choose (built-in,
        first-party, certified).  The choice is announced on ``corerun.selection`` as ``announce_as``
        (default: the kind)."""
        dev = _device_type(need.device)
        label = announce_as or kind
        if name != "auto":
            reg = self.get(kind, name)
            reasons = reg.unavailable_reasons() + misfits(reg, need)
            if reasons:
                raise PluginUnavailableError(KIND_TITLES[kind], name, reasons)
            announce("%s: '%s' as configured, from %s %s (%s on %s)", label, reg.name, reg.distribution, reg.version,
                     reg.trust_label(dev), dev)
            _warn_if_emulated(reg, dev, label)
            return Selection(reg, "as configured", [])
        eligible, passed = self.auto_ranking(kind, need)
        why_not = [f"{r.name}: {why}" for r, why in passed]
        if not eligible:
            raise PluginUnavailableError(KIND_TITLES[kind], "auto", why_not or [f"no {KIND_TITLES[kind]} is installed"])
        best = eligible[0]
        reason = f"{best.trust_label(dev)}, priority {best.priority_on(dev)} on {dev}"
        others = f"; passed over {', '.join(r.name for r, _ in passed)} (corerun -v says why)" if passed else ""
        announce("%s: auto chose '%s' from %s %s (%s)%s", label, best.name, best.distribution, best.version, reason, others)
        if passed:  # the reasons (some are long install advice) only when asked for: INFO on corerun.registry
            logger.info("%s: auto passed over %s", label, " | ".join(why_not))
        return Selection(best, reason, passed)

    def select_attention(self, name: str, spec: Any) -> Registration:
        """The attention backend for the model's AttentionSpec (see :meth:`select`)."""
        return self.select("attention", name, spec).registration


@dataclass
class Selection:
    """What :meth:`Registry.select` chose, why, and every implementation ``auto`` passed over with why."""

    registration: Registration
    reason: str  # "as configured", or "<trust>, priority <p> on <device>"
    passed_over: list[tuple[Registration, str]]

    @property
    def name(self) -> str:
        return self.registration.name


_warned_emulated: set[tuple[str, str, str]] = set()  # (kind, name, device type) warned about in this process


def _warn_if_emulated(reg: Registration, dev: str, label: str) -> None:
    """Warn once per process when an implementation named explicitly runs in an interpreter or emulator
    on ``dev`` (its capabilities' ``emulated_on``): it works, many times slower than native code."""
    key = (reg.kind, reg.name, dev)
    if dev not in (getattr(reg.capabilities, "emulated_on", None) or ()) or key in _warned_emulated:
        return
    _warned_emulated.add(key)
    logger.warning(
        "%s: '%s' runs in an interpreter or emulator on %s, not as native code: expect it to be several times "
        "slower than %s: auto, which picks the fastest backend that fits this device", label, reg.name, dev, reg.kind,
    )


def _device_type(device: Any) -> str:
    return getattr(device, "type", None) or str(device).split(":")[0]


def misfits(reg: Registration, need: Any, auto: bool = False) -> list[str]:
    """Why ``reg`` does not fit ``need``: its capabilities' ``fits(need)`` (and for ``auto`` their
    ``suits(need)``), else its declared ``devices``."""
    caps = reg.capabilities
    fits = getattr(caps, "fits", None)
    if fits is not None:
        suits = getattr(caps, "suits", None) if auto else None
        return list(fits(need)) + (list(suits(need)) if suits else [])
    devices = getattr(caps, "devices", None)
    dev = _device_type(need.device)
    return [] if devices is None or dev in devices else [f"device {dev} not in {{{', '.join(sorted(devices))}}}"]


_default: Registry | None = None


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry, loaded from the environment on first use."""
    global _default
    if _default is None or refresh:
        _default = Registry.from_environment()
    return _default
