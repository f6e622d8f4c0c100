"""``corerun new model NAME`` writes a family that installs with pip, is listed by ``corerun plugins``
under its architecture name and passes ``corerun conformance model:ARCH`` (against transformers'
Llama, in float64) unedited, importing nothing private."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from click.testing import CliRunner

from corerun.cli import cli
from corerun.scaffold import architecture
from tests.helpers.thirdparty import Site, check
from tests.test_plugin_imports import is_public


def test_architecture_names_follow_transformers_spelling() -> None:
    assert architecture("foo") == "FooForCausalLM"
    assert architecture("my_llama2") == "MyLlama2ForCausalLM"


@pytest.mark.timeout(600)
def test_scaffolded_model_installs_lists_and_passes_conformance(tmp_path: Path) -> None:
    done = CliRunner().invoke(cli, ["new", "model", "foo", "--dir", str(tmp_path / "src")])
    assert done.exit_code == 0, done.output
    assert "corerun conformance model:FooForCausalLM" in done.output
    root = tmp_path / "src" / "corerun-model-foo"
    for rel in ("corerun_model_foo/plugin.py", "corerun_model_foo/model.py", "tests/test_conformance.py"):
        imported = [n.module for n in ast.walk(ast.parse((root / rel).read_text())) if isinstance(n, ast.ImportFrom)]
        assert all(is_public(m) for m in imported), (rel, imported)
    site = Site(tmp_path / "site")
    site.install([root])
    env = {"CORERUN_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "200"}
    listed = check(site.corerun(["plugins"], **env))
    assert "FooForCausalLM" in listed and "corerun-model-foo" in listed, listed
    conformance = site.corerun(["conformance", "model:FooForCausalLM", "-k", "gqa-untied"], timeout=500, **env)
    out = check(conformance)
    # every check of the suite ran on the shape and passed (the count grows with the suite's checks)
    assert "model:FooForCausalLM: PASS" in out and " failed" not in out and "preemption" in out, out
