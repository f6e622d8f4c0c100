"""The bundled plugins use corerun as a third party would: every ``corerun`` module a file under
``plugins/`` (or a plugin ``corerun new`` writes) imports is on the public surface that
docs/plugins.md (*What a plugin may import*) lists, and no plugin imports the repository's ``tests``.

The check reads each file with :mod:`ast` (nothing is imported), so an import inside a function or
under ``TYPE_CHECKING`` counts too, and so does ``importlib.import_module("corerun.x")``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import corerun

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "plugins.md"

# Public modules: each one and everything below it.  Kept equal to the list in docs/plugins.md (tested below).
PUBLIC = (
    "corerun.sdk",
    "corerun.testing",
    "corerun.protocols",
    "corerun.conformance",
    "corerun.errors",
    "corerun.sampling_params",
    "corerun.tool_parsers",
)


def is_public(module: str) -> bool:
    """Whether a plugin may import ``module`` (a dotted name); names outside corerun are not judged."""
    if module == "tests" or module.startswith("tests."):
        return False
    if module != "corerun" and not module.startswith("corerun."):
        return True
    return module == "corerun" or any(module == p or module.startswith(p + ".") for p in PUBLIC)


def private_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in the Python file ``path`` that leaves the public surface.

    ``from corerun import name`` is public when ``name`` is one of ``corerun.__all__`` or a public
    submodule; any other name there is a private submodule reached through the package.
    """
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if not is_public(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not is_public(node.module):
                found.append((node.lineno, node.module))
            elif node.module == "corerun":
                found += [
                    (node.lineno, f"corerun.{a.name}")
                    for a in node.names
                    if a.name not in corerun.__all__ and not is_public(f"corerun.{a.name}")
                ]
        elif (
            isinstance(node, ast.Call)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))
            )
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and not is_public(node.args[0].value)
        ):
            found.append((node.lineno, node.args[0].value))
    return sorted(found)


def plugin_files() -> list[Path]:
    return sorted(
        p for p in (ROOT / "plugins").rglob("*.py")
        if not any(part.startswith(".") or part in ("build", "__pycache__") or part.endswith(".egg-info") for part in p.parts)
    )


def test_the_bundled_plugins_import_only_public_corerun_modules() -> None:
    files = plugin_files()
    assert len(files) > 20 and any("sampler_basic" in str(p) for p in files)  # the walk found the plugins
    problems = [
        f"{p.relative_to(ROOT)}:{line}: imports {module}, which is private to corerun"
        for p in files
        for line, module in private_imports(p)
    ]
    assert problems == [], "\n".join(problems)


def test_corerun_new_writes_plugins_that_import_only_public_modules(tmp_path: Path) -> None:
    from corerun.scaffold import KINDS, scaffold

    for kind in KINDS:
        files = sorted(scaffold(kind, "mine", tmp_path).rglob("*.py"))
        assert len(files) >= 3, (kind, files)
        problems = [f"{kind}: {p.name}:{line}: {module}" for p in files for line, module in private_imports(p)]
        assert problems == [], "\n".join(problems)


def test_the_check_names_file_line_and_module(tmp_path: Path) -> None:
    bad = tmp_path / "backend.py"
    bad.write_text(
        "import torch\n"
        "from corerun import LLM, hookimpl\n"
        "from corerun.sdk.attention import DenseKVCache\n"
        "from corerun.testing import requests_step\n"
        "from corerun.attention.dense_cache import DenseKVCache\n"
        "def build():\n"
        "    import corerun.graph.cuda\n"
        "    from corerun import cache\n"
        "    from tests.helpers.thirdparty import Site\n"
        "    import importlib\n"
        "    return importlib.import_module('corerun.models.default')\n",
        encoding="utf-8",
    )
    assert private_imports(bad) == [
        (5, "corerun.attention.dense_cache"),
        (7, "corerun.graph.cuda"),
        (8, "corerun.cache"),
        (9, "tests.helpers.thirdparty"),
        (11, "corerun.models.default"),
    ]
    good = tmp_path / "sampler.py"
    good.write_text("from corerun.sdk.sampling import exponential_race\nfrom corerun.sdk import Registry, hookimpl\nfrom corerun import errors\n")
    assert private_imports(good) == []


def test_the_public_surface_is_the_one_documented() -> None:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("### What a plugin may import", 1)[1].split("\n#", 1)[0]
    heads = [line.split(": ", 1)[0] for line in section.splitlines() if line.startswith("- `corerun")]
    documented = {m for head in heads for m in re.findall(r"`(corerun(?:\.[a-z_]+)*)(?:\.\*)?`", head)}
    assert documented == {"corerun", *PUBLIC}, sorted(documented ^ {"corerun", *PUBLIC})
