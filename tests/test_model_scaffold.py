"""``corerun new model NAME`` writes a family that installs with pip, is listed by ``corerun plugins``
under its architecture name and passes ``corerun conformance model:ARCH`` (against transformers'
Llama, in float64) unedited, importing nothing private."""

from __future__ import annotations

import ast
import json
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from corerun.cli import cli
from corerun.scaffold import architecture
from corerun.testing.reference import hf_greedy
from tests.helpers.serving import http, tiny_chat_model
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
    # and `corerun serve` runs a folder whose config.json names the family, with transformers' greedy tokens
    llama = tiny_chat_model(tmp_path / "llama")
    foo = tmp_path / "foo-model"
    shutil.copytree(llama, foo)
    cfg = json.loads((foo / "config.json").read_text())
    (foo / "config.json").write_text(json.dumps({**cfg, "architectures": ["FooForCausalLM"]}))
    prompt = [5, 17, 99, 3, 41]
    from tests.test_server_cli import start_serve  # (needs the serve extra)

    proc, url, lines = start_serve([sys.executable, "-m", "corerun", "serve", "--model", str(foo), "--port", "0",
                                    "--device", "cpu", "--dtype", "float32", "--attention", "torch",
                                    "--served-model-name", "foo"], env=site.env(**env))
    try:
        status, body = http(url + "/v1/completions", {"model": "foo", "prompt": prompt, "max_tokens": 4,
                                                      "temperature": 0, "ignore_eos": True})
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert status == 200, body
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(str(llama)).decode(hf_greedy(llama, [prompt], 4)[0])
    assert body["choices"][0]["text"] == want, (body, want)
