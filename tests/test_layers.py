"""The layer contract: each layer of corerun imports only the layers below it.

The contract lives in ``pyproject.toml`` (``[tool.importlinter]``); import-linter checks it on the
package as it is, and, so that the check is known to bite, on a copy with one upward import added.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"]


def _lint(package_parent: Path, config: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([*LINT, "--config", str(config), "--no-cache"], cwd=package_parent, env=env,
                          capture_output=True, text=True, timeout=120)


def test_layers_are_kept() -> None:
    done = _lint(ROOT, ROOT / "pyproject.toml")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "corerun layers KEPT" in done.stdout


def test_an_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "corerun", tmp_path / "corerun", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    seq = tmp_path / "corerun" / "core" / "sequence.py"
    seq.write_text(seq.read_text() + "\nimport corerun.engine.llm_engine  # upward: core -> engine\n")
    done = _lint(tmp_path, tmp_path / "pyproject.toml")
    assert done.returncode != 0
    assert "corerun.core.sequence -> corerun.engine.llm_engine" in done.stdout, done.stdout[-3000:]


@pytest.mark.parametrize(("module", "upward"), [
    ("quantization/base.py", "corerun.models.layers"),  # quantization sits below the model layers that use it
    ("tool_parsers/protocol.py", "corerun.server.tool_calls"),  # tool parsers are a leaf the server uses
    ("platform/host.py", "corerun.protocols.attention"),  # host facts sit below every layer
    ("sampler/full.py", "corerun.sdk.sampling"),  # the stack never imports the sdk; the sdk re-exports the stack
    ("runner/model_runner.py", "corerun.testing.engines"),  # nor the test toolkit
    ("testing/stats.py", "corerun.conformance.suite"),  # the conformance suites use corerun.testing, not the reverse
    ("errors.py", "corerun.config"),  # the user API's errors sit below the config that raises them
    ("sampling_params.py", "corerun.core.sequence"),  # the user API's values import no layer
])
def test_the_newer_packages_are_in_the_contract(tmp_path: Path, module: str, upward: str) -> None:
    shutil.copytree(ROOT / "corerun", tmp_path / "corerun", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / "corerun" / module
    path.write_text(path.read_text() + f"\nimport {upward}  # upward\n")
    done = _lint(tmp_path, tmp_path / "pyproject.toml")
    importer = "corerun." + module.removesuffix(".py").replace("/", ".")
    assert done.returncode != 0 and f"{importer} -> {upward}" in done.stdout, done.stdout[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("module", "added", "chain"), [
    # an import inside a function counts: the benchmark's corerun worker once reached up into the CLI this way
    ("bench/peers/corerun_worker.py", "\ndef _options():\n    import corerun.cli.options\n",
     "corerun.bench.peers.corerun_worker -> corerun.cli.options"),
    # so does an import made only for type checking: sharding once named the models' config this way
    ("distributed/sharding.py", "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from corerun.models.config import ModelConfig\n",
     "corerun.distributed.sharding -> corerun.models.config"),
])
def test_lazy_and_type_only_upward_imports_break_the_contract(tmp_path: Path, module: str, added: str, chain: str) -> None:
    shutil.copytree(ROOT / "corerun", tmp_path / "corerun", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / "corerun" / module
    path.write_text(path.read_text() + added)
    done = _lint(tmp_path, tmp_path / "pyproject.toml")
    assert done.returncode != 0 and chain in done.stdout, done.stdout[-3000:]


def test_only_the_user_api_is_left_at_the_top() -> None:
    # everything else lives in a package the contract above places; a new loose module fails here
    user_api = {"__init__", "__main__", "_version", "config", "errors", "llm", "outputs", "sampling_params"}
    loose = {p.stem for p in (ROOT / "corerun").glob("*.py")}
    assert loose == user_api, f"modules loose at the top of corerun/ besides the user API: {sorted(loose - user_api)}"


def _contract_names() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    names: set[str] = set()
    for contract in config["contracts"]:
        for key in ("layers", "containers", "source_modules", "forbidden_modules", "modules"):
            for entry in contract.get(key, []):
                names.update(n.strip() for n in entry.replace(":", "|").split("|"))
    return names


def test_every_package_is_in_a_contract() -> None:
    # every module under corerun/ is named by a contract or lies inside a package that is; a package split
    # over several layers (corerun.plugin, corerun itself) is covered through its modules, so only its
    # __init__ may go unnamed
    names = _contract_names()
    uncovered = []
    for path in sorted((ROOT / "corerun").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            continue
        module = ".".join(parts)
        if not any(module == n or module.startswith(n + ".") for n in names):
            uncovered.append(module)
    packages = {".".join(p.relative_to(ROOT).parts) for p in (ROOT / "corerun").rglob("*") if (p / "__init__.py").is_file()}
    assert "corerun.sdk" in packages and "corerun.testing" in packages  # the walk sees the packages themselves
    assert uncovered == [], f"modules under corerun/ that no import-linter contract in pyproject.toml names: {uncovered}"
