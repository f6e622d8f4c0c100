"""``corerun conformance KIND:NAME``: run the conformance suite against an installed implementation.

The suite runs through pytest in this process, exactly as
``pytest --pyargs corerun.conformance --corerun-impl KIND:NAME`` runs it (the options map onto
pytest's ``-k`` and the plugin's ``--corerun-*`` options; :mod:`corerun.conformance.runner`).
Prints a table (check, case, result, reason) or, with ``--json``, a document with every result.
Exit status: 0 when at least one check passed and none failed (expected failures with their reasons
are fine); 1 when any check failed, errored or unexpectedly passed; 3 when the implementation's plugin
or factory module fails to import (an error, with the traceback's last line); 5 when nothing ran
(every check skipped, e.g. the implementation is unavailable here, or ``-k`` selected nothing); 2 on
usage errors.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import click

EXIT_NOTHING_RAN = 5
EXIT_IMPORT_FAILED = 3  # the implementation's plugin or module cannot be imported: nothing was checked
STYLES = {"passed": "green", "failed": "bold red", "error": "bold red", "xpassed": "bold red", "skipped": "yellow", "xfailed": "cyan"}


def _document(target: Any, results: list[Any], seconds: float, args: list[str]) -> dict[str, Any]:
    import shlex

    from corerun.conformance.runner import summarize

    counts = summarize(results)
    reg = target.registration
    return {
        "implementation": target.label,
        "pytest": "pytest " + shlex.join(args),  # the same run, through pytest
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


def _wrap(text: str, width: int, indent: str) -> list[str]:
    import textwrap

    lines: list[str] = []
    for raw in text.splitlines() or [""]:
        sub = indent + " " * (len(raw) - len(raw.lstrip()))
        lines += textwrap.wrap(raw.strip(), width=width, initial_indent=sub, subsequent_indent=sub + "  ",
                               break_on_hyphens=False) or [sub]
    return lines


REASON_LINES = 8  # of each failure block without -v
CASES_SHOWN = 6  # case ids listed in a block's header without -v


def _shown(ids: list[str], verbose: bool, most: int) -> str:
    if verbose or len(ids) <= most:
        return ", ".join(ids)
    return ", ".join(ids[:most]) + f" and {len(ids) - most} more"


def _render(doc: dict[str, Any], results: list[Any], verbose: bool = False) -> None:
    """Per check, one line of counts; a one-line diagnosis per failed check; then identical failures as
    one block listing their cases (and grouped skips and expected failures), wrapped to the terminal
    so it reads at 80 columns.  Without ``verbose`` a block keeps its first lines and first cases."""
    from rich.console import Console
    from rich.markup import escape

    from corerun.conformance.report import diagnose, group_failures

    console = Console(highlight=False)
    width = max(40, min(console.width, 100))
    console.print(f"[bold]corerun conformance {doc['implementation']}[/bold]")
    by_check: dict[str, dict[str, int]] = {}
    for r in results:
        counts = by_check.setdefault(r.check, {})
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    name_width = max([len(c) for c in by_check] + [5])
    for check, counts in by_check.items():
        parts = ", ".join(f"[{STYLES[o]}]{n} {o}[/]" for o, n in counts.items())
        console.print(f"  {check:<{name_width}}  {parts}")
    diagnosis = diagnose(results)
    if diagnosis:
        console.print("\n[bold]diagnosis[/bold]")
        for line in diagnosis:
            for wrapped in _wrap(line, width, "  "):
                console.print(escape(wrapped))
    hidden = 0
    for group in group_failures(results):
        cases = group.cases
        where = f"{group.check}\\[{escape(cases[0])}]" if len(cases) == 1 else (
            f"{group.check}, {len(cases)} cases alike: {escape(_shown(cases, verbose, CASES_SHOWN))}")
        console.print(f"\n[{STYLES[group.outcome]}]{group.outcome.upper()}[/] {where}")
        if not group.identical:
            console.print(f"  (as {escape(cases[0])} says; the figures differ from case to case)", style="dim")
        lines = _wrap(group.reason, width, "  ")
        if not verbose and len(lines) > REASON_LINES:
            hidden += 1
            more = len(lines) - REASON_LINES
            lines = lines[:REASON_LINES] + [f"  ... {more} more line{'s' if more > 1 else ''}"]
        for line in lines:
            console.print(escape(line))
    if hidden:
        console.print(f"\n{hidden} failure block(s) cut short: `corerun conformance -v {doc['implementation']}` prints them whole.")
    for outcome in ("xfailed", "skipped"):
        grouped: dict[str, list[str]] = {}
        for r in results:
            if r.outcome == outcome:
                grouped.setdefault(r.reason, []).append(f"{r.check}[{r.case}]")
        for reason, ids in grouped.items():
            shown = _shown(ids, verbose, 3)
            console.print(f"\n[{STYLES[outcome]}]{outcome}[/] {escape(shown)}")
            for line in _wrap(reason, width, "  "):
                console.print(escape(line))
    parts = [f"{n} {k}" for k, n in doc["summary"].items() if n]
    verdict = "[bold green]PASS[/]" if doc["ok"] else "[bold red]FAIL[/]"
    console.print(f"\n{doc['implementation']}: {verdict}  {', '.join(parts) or 'no checks selected'} in {doc['seconds']:.1f}s")
    if doc.get("certificate_note"):
        for line in _wrap(doc["certificate_note"], width, ""):
            console.print(escape(line))


def _certify(target: Any, results: list[Any], device: str, partial: str | None) -> tuple[str | None, str]:
    """Record a certificate for a complete, passed run of a registered third-party implementation:
    ``(path or None, what was done and why)``."""
    from corerun.plugin import trust
    from corerun.conformance.runner import summarize

    reg = target.registration
    if reg is None:
        return None, ""
    if reg.origin != trust.THIRD_PARTY:
        return None, f"{reg.distribution} is {reg.origin}: `auto` may choose it without a certificate."
    if exit_code(results) != 0:
        if partial and not partial.startswith("-k"):  # other settings than the certified ones failed
            return None, f"not certified: the run did not pass ({partial}); a certificate of the default settings stays."
        revoked = trust.revoke_certificate(reg, device, summarize(results))
        return None, (f"not certified: the run did not pass, so `auto` will not choose {target.label}"
                      + (f"; its certificate is revoked ({revoked})." if revoked else "."))
    if partial:
        return None, f"not certified: {partial}; run the whole suite (`corerun conformance {target.label}`) to certify it."
    counts = summarize(results)
    if counts["xfailed"]:
        return None, f"not certified: {counts['xfailed']} expected failures; `auto` only chooses what passed every check."
    path = trust.record_certificate(reg, device, counts)
    proved = trust.fingerprint(reg, device)
    return str(path), (
        f"certified {target.label} from {reg.distribution} {reg.version} ({proved['files_from']}) for corerun "
        f"{trust.__version__}, torch {proved['torch_version']} on {proved['device_kind']} ({path})"
        + (": `attention: auto` may now choose it." if reg.kind == "attention" else ".")
    )


@click.command("conformance")
@click.argument("implementation", metavar="KIND:NAME")
@click.option("--json", "as_json", is_flag=True, help="Print the results as one JSON document.")
@click.option("-k", "keyword", default=None, metavar="EXPR", help="pytest's -k: only tests whose name matches, e.g. 'decode and not bf16'.")
@click.option("--full-matrix", is_flag=True, default=None, help="The full cross product of declared capabilities (also CORERUN_FULL_MATRIX=1).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Run on this device (default: cuda when available and declared).")
@click.option("--xfail", "xfails", multiple=True, metavar="PATTERN=REASON", help="Declare an expected failure: a pattern over 'check[case]' (* and ? wildcards) and why.")
@click.option("--option", "option_items", multiple=True, metavar="KEY=VALUE", help="An option for the implementation, validated by its plugin (e.g. num_splits=4); repeatable.")
@click.option("--attention", "attention", default=None, metavar="NAME", help="graph runners only: the attention backend the suite's model attends with (default torch), e.g. triton.")
@click.option("-v", "--verbose", is_flag=True, help="Every failure block whole, with every case (also `corerun -v conformance`).")
def conformance(implementation: str, as_json: bool, keyword: str | None, full_matrix: bool | None, device: str | None, xfails: tuple[str, ...], option_items: tuple[str, ...], attention: str | None, verbose: bool) -> None:
    """Run the conformance suite against KIND:NAME (attention:triton, sampler:full, kv_cache:paged, graph:eager)."""
    from corerun.conformance.runner import run_suite, suite_class
    from corerun.conformance.settings import parse_impl, parse_option, parse_xfail
    from corerun.conformance.target import Target
    from corerun.errors import PluginError

    try:
        kind, name = parse_impl(implementation)
        expected = dict(parse_xfail(x) for x in xfails)
        options = dict(parse_option(item) for item in option_items)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if attention is not None and kind != "graph":
        raise click.UsageError(
            f"--attention {attention!r} only applies to graph runners (graph:NAME), not to {kind}:{name}; "
            f"to check an attention backend itself run `corerun conformance attention:{attention}`"
        )
    try:
        target = Target.registered(kind, name, options)
        if attention is not None:
            from corerun.plugin.registry import get_registry

            get_registry().get("attention", attention)  # an unknown name: the registry's did-you-mean
    except PluginError as exc:
        _exit_if_a_plugin_failed_to_import(f"{kind}:{name}", None)
        raise click.UsageError(str(exc)) from None
    _exit_if_a_plugin_failed_to_import(f"{kind}:{name}", target.registration)
    start = time.perf_counter()
    try:
        with nullcontext() if as_json else _status(f"running the {kind} suite against {name}") as status:
            from rich.markup import escape

            progress = None if status is None else lambda r: status.update(escape(f"{r.id}: {r.outcome}"))
            results, args = run_suite(f"{kind}:{name}", keyword=keyword, full_matrix=full_matrix, device=device,
                                      xfails=expected, options=option_items, attention=attention, progress=progress)
    except ValueError as exc:  # pytest's usage errors: a malformed -k expression
        raise click.UsageError(str(exc)) from None
    doc = _document(target, results, time.perf_counter() - start, args)
    if kind == "graph":
        doc["attention_backend"] = attention or suite_class(kind).attention_backend  # what the suite's model attended with
    partial = (
        "-k selected a subset of the checks" if keyword else "--option changed the implementation's options" if options
        else "--attention changed the suite's model" if attention else None
    )
    run_device = device or suite_class(kind)().pick_device(target)
    doc["certificate"], doc["certificate_note"] = _certify(target, results, run_device, partial)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        root = click.get_current_context().find_root().params.get("verbose")
        _render(doc, results, verbose=verbose or bool(root))
    sys.exit(exit_code(results))


def _exit_if_a_plugin_failed_to_import(label: str, registration: Any) -> None:
    """An implementation whose factory module fails to import, or (when ``registration`` is None, the
    name being unknown) any plugin whose entry point failed to import, is an error, not a skip: print
    each with its traceback's last line and exit with EXIT_IMPORT_FAILED."""
    from corerun.conformance.pytest_plugin import import_failures

    failures = import_failures(registration)
    if not failures:
        return
    click.echo(f"error: {label} cannot be checked: its plugin fails to import", err=True)
    for failure in failures:
        click.echo(f"  {failure}", err=True)
    click.echo("nothing was checked and no certificate changed; `python -c 'import MODULE'` shows the whole traceback",
               err=True)
    sys.exit(EXIT_IMPORT_FAILED)


@contextmanager
def _status(text: str) -> Iterator[Any]:
    """A spinner on the terminal's stderr, written through its own descriptor so that pytest's
    capture of each test's output does not swallow it."""
    import os

    from rich.console import Console

    try:
        stream = os.fdopen(os.dup(sys.__stderr__.fileno()), "w")
    except (AttributeError, OSError, ValueError):
        stream = None
    try:
        with Console(file=stream, stderr=stream is None).status(text) as status:
            yield status
    finally:
        if stream is not None:
            stream.close()
