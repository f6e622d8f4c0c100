"""``corerun conformance KIND:NAME``: run the conformance suite against an installed implementation.

Prints a table (check, case, result, reason) or, with ``--json``, a document with every result.
Exit status: 0 when at least one check passed and none failed (expected failures with their reasons
are fine); 1 when any check failed, errored or unexpectedly passed; 5 when nothing ran (every check
skipped, e.g. the implementation is unavailable here, or ``-k`` selected nothing); 2 on usage errors.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click

EXIT_NOTHING_RAN = 5
STYLES = {"passed": "green", "failed": "bold red", "error": "bold red", "xpassed": "bold red", "skipped": "yellow", "xfailed": "cyan"}


def _document(target: Any, results: list[Any], seconds: float) -> dict[str, Any]:
    from corerun.conformance.runner import summarize

    counts = summarize(results)
    reg = target.registration
    return {
        "implementation": target.label,
        "distribution": getattr(reg, "distribution", None),
        "version": getattr(reg, "version", None),
        "capabilities": target.capabilities.to_dict() if hasattr(target.capabilities, "to_dict") else None,
        "unavailable_reasons": target.unavailable_reasons(),
        "summary": counts,
        "ok": exit_code(results) == 0,
        "seconds": round(seconds, 3),
        "results": [r.to_dict() for r in results],
    }


def exit_code(results: list[Any]) -> int:
    if any(r.failed for r in results):
        return 1
    if not any(r.outcome in ("passed", "xfailed") for r in results):
        return EXIT_NOTHING_RAN
    return 0


def _render(doc: dict[str, Any], results: list[Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    table = Table(title=f"corerun conformance {doc['implementation']}", title_justify="left")
    table.add_column("check", no_wrap=True)
    table.add_column("case", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("reason", overflow="fold", ratio=1)
    for r in results:
        table.add_row(Text(r.check), Text(r.case), Text(r.outcome, style=STYLES.get(r.outcome, "")), Text(r.reason))
    console.print(table)
    parts = [f"{n} {k}" for k, n in doc["summary"].items() if n]
    verdict = Text("PASS" if doc["ok"] else "FAIL", style="bold green" if doc["ok"] else "bold red")
    console.print(Text(f"{doc['implementation']}: ") + verdict + Text(f"  {', '.join(parts) or 'no checks selected'} in {doc['seconds']:.1f}s"))


def _parse_options(items: tuple[str, ...]) -> dict:
    """``("num_splits=4",)`` -> ``{"num_splits": 4}``; values are read as YAML scalars."""
    import yaml

    options = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--option expects KEY=VALUE (e.g. num_splits=4), got {item!r}")
        try:
            options[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ValueError(f"--option {item!r}: the value is not valid YAML: {exc}") from None
    return options


@click.command("conformance")
@click.argument("implementation", metavar="KIND:NAME")
@click.option("--json", "as_json", is_flag=True, help="Print the results as one JSON document.")
@click.option("-k", "keyword", default=None, metavar="EXPR", help="Only checks whose id matches, pytest style: 'decode and not bf16'.")
@click.option("--full-matrix", is_flag=True, default=None, help="The full cross product of declared capabilities (also CORERUN_FULL_MATRIX=1).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Run on this device (default: cuda when available and declared).")
@click.option("--xfail", "xfails", multiple=True, metavar="PATTERN=REASON", help="Declare an expected failure: a pattern over 'check[case]' (* and ? wildcards) and why.")
@click.option("--option", "option_items", multiple=True, metavar="KEY=VALUE", help="An option for the implementation, validated by its plugin (e.g. num_splits=4); repeatable.")
@click.option("--attention", "attention", default=None, metavar="NAME", help="graph runners only: the attention backend the suite's model attends with (default torch), e.g. triton.")
def conformance(implementation: str, as_json: bool, keyword: str | None, full_matrix: bool | None, device: str | None, xfails: tuple[str, ...], option_items: tuple[str, ...], attention: str | None) -> None:
    """Run the conformance suite against KIND:NAME (attention:triton, sampler:full, kv_cache:paged, graph:eager)."""
    try:
        import pytest  # noqa: F401  (the suites use pytest's skip / fail outcomes)
    except ImportError:
        raise click.ClickException("corerun conformance needs pytest: pip install pytest") from None
    from corerun.conformance.keyword import compile_keyword
    from corerun.conformance.runner import run_suite, suite_class
    from corerun.conformance.settings import parse_impl, parse_xfail
    from corerun.errors import PluginError

    try:
        kind, name = parse_impl(implementation)
        expected = dict(parse_xfail(x) for x in xfails)
        compile_keyword(keyword)
        options = _parse_options(option_items)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if attention is not None and kind != "graph":
        raise click.UsageError(
            f"--attention {attention!r} only applies to graph runners (graph:NAME), not to {kind}:{name}; "
            f"to check an attention backend itself run `corerun conformance attention:{attention}`"
        )
    attrs = {
        "implementation": name, "full_matrix": full_matrix or None, "device": device, "expected_failures": expected,
        "options": options,
    }
    if attention is not None:
        attrs["attention_backend"] = attention
    cls = type(f"Conformance_{kind}_{name}", (suite_class(kind),), attrs)
    try:
        target = cls.resolve_targets()[0]
        if attention is not None:
            from corerun.registry import get_registry

            get_registry().get("attention", attention)  # an unknown name: the registry's did-you-mean
    except PluginError as exc:
        raise click.UsageError(str(exc)) from None
    start = time.perf_counter()
    if as_json:
        results = run_suite(cls, keyword=keyword)
    else:
        from rich.console import Console

        with Console(stderr=True).status(f"running the {kind} suite against {name}") as status:
            results = run_suite(cls, keyword=keyword, progress=lambda r: status.update(f"{r.id}: {r.outcome}"))
    doc = _document(target, results, time.perf_counter() - start)
    if kind == "graph":
        doc["attention_backend"] = cls.attention_backend  # what the suite's model attended with
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        _render(doc, results)
    sys.exit(exit_code(results))
