"""``corerun plugins``: every installed plugin, what it provides, and whether it can run here.

Loading the plugins imports no torch or kernel library; only the availability probes may (the
``flash`` probe asks torch for a CUDA device).  ``--no-probe`` lists without running them.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import sys
from typing import Any

import click

from corerun._version import PROTOCOL_VERSION, __version__
from corerun.plugin.capabilities import Need
from corerun.plugin.registry import ENTRY_POINT_GROUP, ENV_ALLOW_LIST, Registry


def describe(registry: Registry, probe: bool = True) -> dict[str, Any]:
    """The machine-readable document ``corerun plugins --json`` prints.

    Keys: ``corerun`` (version, protocol_version), ``allow_list`` (the ``CORERUN_PLUGINS`` names, or
    null when unset), ``plugins`` (one per loaded plugin: id, distribution, version, ``provides`` as
    ``kind:name``), ``implementations`` (every registration with its capabilities and, when probed,
    ``available`` and every ``reasons``), ``conflicts`` (names registered more than once, with each
    registrant), ``load_errors`` (plugin, distribution, error) and ``not_loaded`` (entry points that
    ``CORERUN_PLUGINS`` left out).
    """
    env = os.environ.get(ENV_ALLOW_LIST)
    implementations = registry.all()
    conflicting = [r for regs in registry.duplicates.values() for r in regs]
    provides: dict[str, list[str]] = {p: [] for p in registry.plugins}
    for r in implementations + conflicting:
        provides.setdefault(r.plugin, []).append(f"{r.kind}:{r.name}")
    loaded = set(registry.plugins) | {e.plugin for e in registry.load_errors}
    return {
        "corerun": {"version": __version__, "protocol_version": PROTOCOL_VERSION},
        "allow_list": None if env is None else [p.strip() for p in env.split(",") if p.strip()],
        "plugins": [
            {"plugin": p, "distribution": dist, "version": ver, "provides": sorted(provides[p])}
            for p, (dist, ver) in sorted(registry.plugins.items())
        ],
        "implementations": [r.to_dict(with_availability=probe) for r in implementations],
        "conflicts": [
            {
                "kind": kind,
                "name": name,
                "registrations": [{"plugin": r.plugin, "distribution": r.distribution, "version": r.version} for r in regs],
            }
            for (kind, name), regs in sorted(registry.duplicates.items())
        ],
        "load_errors": [e.to_dict() for e in registry.load_errors],
        "filter_warnings": list(registry.filter_warnings),
        "auto": auto_choices(registry) if probe else [],
        "not_loaded": [
            {"plugin": ep.name, "distribution": ep.dist.name if ep.dist is not None else "?"}
            for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
            if env is not None and ep.name not in loaded
        ],
    }


AUTO_DEVICES = ("cpu", "cuda")


def auto_choices(registry: Registry) -> list[dict[str, Any]]:
    """Per kind and per device type: what ``auto`` would pick (:meth:`Registry.select`'s ranking) and why
    each other implementation was passed over.  At startup attention is also narrowed by the model's
    spec, and the graph runner is ranked against the attention backend chosen here."""
    out: list[dict[str, Any]] = []
    for device in AUTO_DEVICES:
        attention = None
        for kind in ("attention", "graph", "sampler", "kv_cache", "lora", "fused_ops"):
            eligible, passed = registry.auto_ranking(kind, Need(device, attention=attention))
            best = eligible[0] if eligible else None
            if kind == "attention":
                attention = best.capabilities if best else None
            out.append({
                "kind": kind, "device": device, "choice": best.name if best else None,
                "reason": (
                    f"{best.trust_label(device)}, highest priority ({best.priority_on(device)}) among the capable, "
                    f"available and trusted" if best else "nothing is capable, available and trusted"
                ),
                "passed_over": [{"name": r.name, "why": why} for r, why in passed],
            })
    return out


def _auto(doc: dict[str, Any]) -> Any:
    from rich.text import Text

    table = _table("What `auto` picks (built-ins, first-party and certified plugins only)",
                   ("kind", "device", "auto picks", "passed over"), no_wrap=("kind", "device"))
    for a in doc["auto"]:
        passed = "\n".join(f"{p['name']}: {p['why']}" for p in a["passed_over"]) or "-"
        choice = Text(a["choice"] or "nothing", style="bold" if a["choice"] else "red")
        table.add_row(Text(a["kind"]), Text(a["device"]), choice + Text(f"\n({a['reason']})", style="dim"),
                      Text(passed))
    return table


def _table(title: str, columns: tuple[str, ...], no_wrap: tuple[str, ...] = ()) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in columns:
        if column in no_wrap:
            table.add_column(column, no_wrap=True)
        else:
            table.add_column(column, overflow="fold", ratio=1 if column == columns[-1] else None)
    return table


def _available_cell(impl: dict[str, Any]) -> Any:
    from rich.text import Text

    if "available" not in impl:
        return Text("not checked", style="dim")
    if impl["available"]:
        return Text("yes", style="green")
    return Text("no\n" + "\n".join(f"- {r}" for r in impl["reasons"]), style="red")


def _implementations(doc: dict[str, Any]) -> Any:
    from rich.text import Text

    columns = ("plugin", "distribution", "version", "kind", "name", "origin", "available")
    table = _table("Installed implementations", columns, no_wrap=("plugin", "distribution", "version", "kind", "name", "origin"))
    for i in doc["implementations"]:
        cells = [Text(i[c]) for c in columns[:4]]
        table.add_row(*cells, Text(i["name"], style="bold"), Text(i["origin"]), _available_cell(i))
    for p in doc["plugins"]:
        if not p["provides"]:
            cells = [Text(p[c]) for c in columns[:3]]
            table.add_row(*cells, "-", "-", "-", Text("provides nothing", style="yellow"))
    return table


def _conflicts(doc: dict[str, Any]) -> Any:
    from rich.text import Text

    table = _table("Name conflicts", ("kind", "name", "registered by"))
    for c in doc["conflicts"]:
        who = "\n".join(f"{r['distribution']} {r['version']} (plugin '{r['plugin']}')" for r in c["registrations"])
        table.add_row(Text(c["kind"]), Text(c["name"], style="bold"), Text(who, style="red"))
    return table


def _load_errors(doc: dict[str, Any]) -> Any:
    from rich.text import Text

    table = _table("Load errors", ("plugin", "distribution", "error"))
    for e in doc["load_errors"]:
        table.add_row(Text(e["plugin"]), Text(e["distribution"]), Text(e["error"], style="red"))
    return table


def render(doc: dict[str, Any]) -> None:
    """Print ``doc`` (from :func:`describe`) as rich tables."""
    from rich.console import Console
    from rich.text import Text

    # Piped output is read by grep and pasted into bug reports: keep rows on one line there.
    console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 200)
    header = f"corerun {doc['corerun']['version']}, protocol version {doc['corerun']['protocol_version']}"
    if doc["allow_list"] is not None:
        header += f"; {ENV_ALLOW_LIST}={','.join(doc['allow_list'])} (only these plugins, plus the built-ins, load)"
    console.print(Text(header))
    console.print(_implementations(doc))
    if doc["conflicts"]:
        console.print(_conflicts(doc))
        note = f"A name registered twice by equals cannot be selected: uninstall one, or leave one out with {ENV_ALLOW_LIST}."
        console.print(Text(note, style="dim"))
    if doc["auto"]:
        console.print(_auto(doc))
    if doc["load_errors"]:
        console.print(_load_errors(doc))
    for warning in doc["filter_warnings"]:
        console.print(Text(f"warning: {warning}", style="yellow"))
    if doc["not_loaded"]:
        skipped = ", ".join(f"{p['plugin']} ({p['distribution']})" for p in doc["not_loaded"])
        console.print(Text(f"Not loaded ({ENV_ALLOW_LIST} leaves them out): {skipped}", style="dim"))


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable JSON document instead of tables.")
@click.option("--no-probe", is_flag=True, help="Skip the availability probes (then nothing imports torch).")
def plugins(as_json: bool, no_probe: bool) -> None:
    """List installed plugins: distribution, version, what each provides, available or why not."""
    doc = describe(Registry.from_environment(), probe=not no_probe)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        render(doc)
