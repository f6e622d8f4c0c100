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
    and ``--corerun-option`` handed to each registered one."""
    from corerun.conformance.target import Target

    if config is None:
        return []
    given = config.stash.get(TARGETS, {}) if hasattr(config, "stash") else {}
    merged = {**options, **dict(parse_option(item) for item in config.getoption("corerun_option", None) or [])}
    targets = []
    for ref in config.getoption("corerun_impl", None) or []:
        ref_kind, name = parse_impl(ref)
        if ref_kind == kind:
            targets.append(given.get((kind, name)) or Target.registered(kind, name, merged))
    return targets


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
