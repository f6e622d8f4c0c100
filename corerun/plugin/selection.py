"""Choosing among the discovered implementations: a name as given (never replaced), or for ``auto`` the
best that fits the ``Need``, every one passed over announced with its reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

from corerun.errors import PluginUnavailableError
from corerun.plugin.registration import KIND_TITLES, Registration

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


def auto_ranking(candidates: Iterable[Registration], need: Any) -> tuple[list[Registration], list[tuple[Registration, str]]]:
    """What ``auto`` considers among ``candidates`` (one kind's registrations) for ``need`` (a
    :class:`~corerun.plugin.capabilities.Need`, or the model's AttentionSpec for attention): the eligible
    implementations, best first (highest priority on the device type, then name), and every other one
    with why it was passed over (what its capabilities say of ``need``, availability, trust).  Only the
    winner's factory module is imported to check it imports (the next in line takes over when it does not)."""
    dev = _device_type(need.device)
    eligible: list[Registration] = []
    passed: list[tuple[Registration, str]] = []
    for reg in sorted(candidates, key=lambda r: r.name):
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


def as_configured(reg: Registration, need: Any, label: str) -> "Selection":
    """``reg``, named in the config, used as asked and never replaced: one that is unavailable or does not
    fit ``need`` raises with every reason.  The choice is announced on ``corerun.selection`` as ``label``."""
    dev = _device_type(need.device)
    reasons = reg.unavailable_reasons() + misfits(reg, need)
    if reasons:
        raise PluginUnavailableError(KIND_TITLES[reg.kind], reg.name, reasons)
    announce("%s: '%s' as configured, from %s %s (%s on %s)", label, reg.name, reg.distribution, reg.version,
             reg.trust_label(dev), dev)
    _warn_if_emulated(reg, dev, label)
    return Selection(reg, "as configured", [])


def choose_auto(kind: str, candidates: Iterable[Registration], need: Any, label: str) -> "Selection":
    """For ``auto``: the highest-priority available one of ``candidates`` that fits ``need`` among those
    ``auto`` may choose (built-in, first-party, certified), announced on ``corerun.selection`` as ``label``;
    none raises with every candidate's reason."""
    dev = _device_type(need.device)
    eligible, passed = auto_ranking(candidates, need)
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


@dataclass
class Selection:
    """What :meth:`~corerun.plugin.registry.Registry.select` chose, why, and every implementation ``auto`` passed over with why."""

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
