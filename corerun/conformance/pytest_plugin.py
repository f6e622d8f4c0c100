"""The ``pytest11`` plugin: ``pytest --pyargs corerun.conformance --corerun-impl KIND:NAME``.

Loaded by pytest in every session where corerun is installed, so it imports nothing heavy.  It adds
the ``--corerun-*`` options and, when ``--corerun-impl`` names implementations, keeps only the
package's suite classes of the selected kinds (``corerun/conformance/test_selected.py``).
``corerun conformance`` runs exactly this collection in-process (:mod:`corerun.conformance.runner`).
"""

from __future__ import annotations

from typing import Any

import pytest

from corerun.conformance.settings import FROM_OPTION, parse_impl, parse_option, parse_xfail

# Targets a caller of pytest.main hands over directly, {(kind, name): Target}: an unregistered
# factory (``corerun.conformance.run(kind, factory=...)``) selected by its ``--corerun-impl`` name.
TARGETS = pytest.StashKey[dict]()


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("corerun", "corerun conformance suite")
    group.addoption(
        "--corerun-impl", action="append", default=[], metavar="KIND:NAME",
        help="implementation the corerun.conformance suite checks, e.g. attention:triton (repeatable)",
    )
    group.addoption(
        "--corerun-full-matrix", action="store_true", default=False,
        help="run the full cross product of declared capabilities (also CORERUN_FULL_MATRIX=1)",
    )
    group.addoption(
        "--corerun-device", default=None, metavar="DEVICE",
        help="device for the corerun conformance suite (cpu or cuda; default: cuda when available and declared)",
    )
    group.addoption(
        "--corerun-xfail", action="append", default=[], metavar="PATTERN=REASON",
        help="declare an expected failure of the corerun conformance suite: PATTERN (* and ? wildcards) over "
        "'check[case]' and its reason (repeatable)",
    )
    group.addoption(
        "--corerun-option", action="append", default=[], metavar="KEY=VALUE",
        help="an option for the --corerun-impl implementations, validated by their plugin (e.g. num_splits=4; "
        "the value is read as YAML; repeatable)",
    )
    group.addoption(
        "--corerun-attention", default=None, metavar="NAME",
        help="graph runners selected by --corerun-impl: the registered attention backend the suite's model "
        "attends with (default torch)",
    )


def pytest_configure(config: Any) -> None:
    try:
        for ref in config.getoption("corerun_impl") or []:
            parse_impl(ref)
        for spec in config.getoption("corerun_xfail") or []:
            parse_xfail(spec)
        for item in config.getoption("corerun_option") or []:
            parse_option(item)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def selected_targets(config: Any, kind: str, options: dict[str, Any]) -> list[Any]:
    """The targets of ``kind`` that ``--corerun-impl`` names (none without a config), with ``options``
    and ``--corerun-option`` handed to each registered one.  A registered implementation whose plugin
    fails to import is a collection error (pytest exits with 2), never a skip."""
    from corerun.conformance.target import Target
    from corerun.errors import PluginError

    if config is None:
        return []
    given = config.stash.get(TARGETS, {}) if hasattr(config, "stash") else {}
    merged = {**options, **dict(parse_option(item) for item in config.getoption("corerun_option", None) or [])}
    targets = []
    for ref in config.getoption("corerun_impl", None) or []:
        ref_kind, name = parse_impl(ref)
        if ref_kind != kind:
            continue
        target = given.get((kind, name))
        if target is None:
            try:
                target = Target.registered(kind, name, merged)
            except PluginError:
                _raise_if_failed(f"{kind}:{name}", import_failures(None))  # the name may be one a broken plugin registers
                raise
        if target.registration is not None:
            _raise_if_failed(f"{kind}:{name}", import_failures(target.registration))
        targets.append(target)
    return targets


def import_failures(registration: Any) -> list[str]:
    """Why a plugin cannot be imported, one line each ending with its traceback's last line: the
    factory module of ``registration``, or with ``None`` (a name not registered) every plugin entry
    point that failed to import.  Empty when everything imports."""
    import traceback

    from corerun.plugin.registry import get_registry, resolve

    failures: list[str] = []
    if registration is not None:
        if registration.import_reasons() and isinstance(registration.factory, str):
            try:
                resolve(registration.factory)
            except Exception as exc:
                last = _last_line("".join(traceback.format_exception_only(type(exc), exc)))
                failures.append(f"{registration.distribution} {registration.version}: import of {registration.factory} failed: {last}")
    else:
        for e in get_registry().load_errors:
            if e.error.startswith("import of "):
                failures.append(f"plugin '{e.plugin}' ({e.distribution}): {e.error.split(' failed: ')[0]} failed: "
                                f"{_last_line(e.detail) or e.error}")
    return failures


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _raise_if_failed(label: str, failures: list[str]) -> None:
    """A collection error (its message alone, no traceback) naming each import failure."""
    if failures:
        raise pytest.Collector.CollectError(
            f"{label} cannot be checked: its plugin fails to import\n" + "\n".join(f"  {f}" for f in failures)
            + "\nnothing was checked; `python -c 'import MODULE'` shows the whole traceback"
        )


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Drop the option-driven suite classes whose kind no ``--corerun-impl`` selects."""
    refs = config.getoption("corerun_impl") or []
    if not refs:
        return
    kinds = {parse_impl(ref)[0] for ref in refs}
    keep, drop = [], []
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and getattr(cls, "implementation", None) == FROM_OPTION and getattr(cls, "kind", None) not in kinds:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
