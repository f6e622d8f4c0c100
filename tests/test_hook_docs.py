"""Meta-tests (as datasette has): every hook spec is documented with its exact signature, and tested.

Documentation is searched in ``README.md`` and ``docs/**/*.md``; tests in ``tests/`` and each
plugin's ``tests/`` folder, where a function named ``test_hook_<hook name>`` must exist.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any, Callable

import pytest

from corerun import hookimpl
from corerun.plugin import hookspecs
from corerun.plugin.registry import Registry

ROOT = Path(__file__).resolve().parents[1]


def docs_text() -> str:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return "\n".join(f.read_text(encoding="utf-8") for f in files if f.is_file())


def signature(func: Callable[..., Any]) -> str:
    """``corerun_samplers(register)``: the name and parameter names, as the documentation writes them."""
    return f"{func.__name__}({', '.join(inspect.signature(func).parameters)})"


def test_hook_specs_are_the_ones_listed_in_hooks() -> None:
    specs = {name for name, obj in vars(hookspecs).items() if callable(obj) and hasattr(obj, "corerun_spec")}
    assert specs == set(hookspecs.HOOKS.values())


@pytest.mark.parametrize("hook", sorted(hookspecs.HOOKS.values()))
def test_hook_is_documented_with_its_signature(hook: str) -> None:
    sig = signature(getattr(hookspecs, hook))
    assert sig in docs_text(), f"document `{sig}` in the README's Plugins section"


def test_register_arguments_are_documented() -> None:
    captured: list[Callable[..., None]] = []

    class Capture:
        @hookimpl
        def corerun_samplers(self, register: Callable[..., None]) -> None:
            captured.append(register)

    Registry().register_module(Capture(), plugin="capture", distribution="capture", version="0")
    (register,) = captured
    text = docs_text()
    missing = [p for p in inspect.signature(register).parameters if f"| `{p}` |" not in text]
    assert missing == [], f"document these register(...) arguments in the table of the README's Plugins section: {missing}"


def _test_functions() -> set[str]:
    files = [*(ROOT / "tests").rglob("test_*.py"), *(ROOT / "plugins").glob("*/tests/**/test_*.py")]
    names: set[str] = set()
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        names |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


@pytest.mark.parametrize(("kind", "hook"), sorted(hookspecs.HOOKS.items()))
def test_hook_has_an_implementation_and_a_test(kind: str, hook: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CORERUN_PLUGINS", raising=False)
    installed = Registry.from_environment().names(kind)
    assert installed, f"no installed plugin implements {hook}"
    tests = [name for name in _test_functions() if name == f"test_hook_{hook}" or name.startswith(f"test_hook_{hook}_")]
    assert tests, f"write a test named test_hook_{hook} exercising an implementation of {hook}"
