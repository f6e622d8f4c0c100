"""The ``pytest11`` plugin: ``pytest --pyargs corerun.conformance --corerun-impl KIND:NAME``.

Loaded by pytest in every session where corerun is installed, so it imports nothing heavy.  It adds
the ``--corerun-*`` options and, when ``--corerun-impl`` names implementations, keeps only the
package's suite classes of the selected kinds (``corerun/conformance/test_selected.py``).
"""

from __future__ import annotations

from typing import Any

from corerun.conformance.settings import FROM_OPTION, parse_impl, parse_xfail


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


def pytest_configure(config: Any) -> None:
    try:
        for ref in config.getoption("corerun_impl") or []:
            parse_impl(ref)
        for spec in config.getoption("corerun_xfail") or []:
            parse_xfail(spec)
    except ValueError as exc:
        import pytest

        raise pytest.UsageError(str(exc)) from None


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
