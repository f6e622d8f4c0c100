"""``corerun conformance KIND:NAME``: table / JSON output, -k selection, exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from click.testing import CliRunner

from corerun.cli import cli

DECODE_FP32 = "decode and fp32"  # one check on one configuration keeps these tests quick


def test_json_reports_every_selected_check() -> None:
    result = CliRunner().invoke(cli, ["conformance", "attention:torch", "--json", "-k", f"({DECODE_FP32}) or kv_write or unsupported"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["implementation"] == "attention:torch" and doc["ok"] is True
    assert doc["distribution"] == "corerun" and "float64" in doc["capabilities"]["dtypes"]
    checks = {r["check"] for r in doc["results"]}
    assert checks == {"decode", "kv_write", "unsupported"}
    assert all(r["id"] == f"attention-torch-{r['check']}[{r['case']}]" for r in doc["results"])
    assert doc["summary"]["passed"] == sum(r["outcome"] == "passed" for r in doc["results"]) > 0
    skipped = [r for r in doc["results"] if r["outcome"] == "skipped"]
    assert [r["check"] for r in skipped] == ["unsupported"]  # torch declares everything: nothing to refuse
    assert "no undeclared combination" in skipped[0]["reason"]


def test_table_and_failure_exit_status() -> None:
    ok = CliRunner().invoke(cli, ["conformance", "kv_cache:paged", "-k", "exhaustion"])
    assert ok.exit_code == 0, ok.output
    assert "exhaustion  4 passed" in ok.output and "PASS" in ok.output
    # a declared expected failure that passes is an unexpected pass: the run fails, saying why
    xpass = CliRunner().invoke(cli, ["conformance", "kv_cache:paged", "-k", "exhaustion", "--xfail", "exhaustion[bs4-*]=tracked upstream"])
    assert xpass.exit_code == 1, xpass.output
    assert "xpassed" in xpass.output and "tracked upstream" in xpass.output and "FAIL" in xpass.output


def test_usage_errors_and_nothing_ran() -> None:
    runner = CliRunner()
    unknown = runner.invoke(cli, ["conformance", "attention:nonexistent"])
    assert unknown.exit_code == 2 and "no attention backend named 'nonexistent'" in unknown.output
    bad = runner.invoke(cli, ["conformance", "attention"])
    assert bad.exit_code == 2 and "KIND:NAME" in bad.output
    no_reason = runner.invoke(cli, ["conformance", "kv_cache:paged", "--xfail", "exhaustion"])
    assert no_reason.exit_code == 2 and "reason" in no_reason.output
    nothing = runner.invoke(cli, ["conformance", "kv_cache:paged", "--json", "-k", "no_such_check"])
    assert nothing.exit_code == 5 and json.loads(nothing.output)["results"] == []
    if not torch.cuda.is_available():
        cuda = runner.invoke(cli, ["conformance", "graph:cuda", "--json", "-k", "oversize"])
        doc = json.loads(cuda.output)
        assert cuda.exit_code == 5 and doc["unavailable_reasons"]
        assert all(r["outcome"] == "skipped" and "unavailable" in r["reason"] for r in doc["results"])


def test_graph_suite_with_another_attention_backend() -> None:
    """``--attention`` swaps the backend the graph suite's model attends with; it is refused elsewhere."""
    runner = CliRunner()
    ok = runner.invoke(cli, ["conformance", "graph:eager", "--attention", "triton", "--json", "-k", "prefill_and_mixed and fp32"])
    doc = json.loads(ok.output)
    assert ok.exit_code == 0, ok.output
    assert [(r["case"], r["outcome"]) for r in doc["results"]] == [("triton-fp32-bs16-max8", "passed")]
    assert doc["attention_backend"] == "triton"
    typo = runner.invoke(cli, ["conformance", "graph:eager", "--attention", "tritn"])
    assert typo.exit_code == 2 and "no attention backend named 'tritn'" in typo.output and "triton" in typo.output
    wrong_kind = runner.invoke(cli, ["conformance", "sampler:full", "--attention", "triton"])
    assert wrong_kind.exit_code == 2 and "only applies to graph runners" in wrong_kind.output


def test_pytest_pyargs_entry(tmp_path) -> None:
    """``pytest --pyargs corerun.conformance --corerun-impl KIND:NAME`` from an unrelated directory."""
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "corerun.conformance", "-p", "no:cacheprovider", "-q",
           "--corerun-impl", "kv_cache:paged"]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "26 passed" in done.stdout and "deselected" in done.stdout, done.stdout


def test_package_suites_skip_without_an_implementation() -> None:
    from corerun.conformance.test_selected import TestAttentionBackend, TestSampler

    class Options:
        def __init__(self, refs: list[str]) -> None:
            self.refs = refs

        def getoption(self, name: str, default: object = None) -> object:
            return self.refs if name == "corerun_impl" else default

    assert TestAttentionBackend.resolve_targets(Options([])) == []
    assert TestAttentionBackend.resolve_targets(Options(["sampler:basic"])) == []
    [target] = TestSampler.resolve_targets(Options(["sampler:basic", "attention:torch"]))
    assert target.label == "sampler:basic" and "temperature" in target.capabilities.params


def test_failures_read_at_80_columns(monkeypatch) -> None:
    """A failing sampler's report: one block per failure naming check[case], wrapped to 80 columns."""
    import corerun.registry as registry_module
    from corerun import hookimpl
    from corerun.registry import Registry
    from tests.broken_impls.sampler import IgnoresTemperatureWithTopK

    class Plugin:
        @hookimpl
        def corerun_samplers(self, register):
            register("topk_no_temp", IgnoresTemperatureWithTopK, capabilities=IgnoresTemperatureWithTopK.capabilities)

    reg = Registry.from_environment(allow=[])
    reg.register_module(Plugin(), plugin="topk_no_temp", distribution="corerun-topk-no-temp", version="0.1")
    monkeypatch.setattr(registry_module, "_default", reg)
    monkeypatch.setenv("COLUMNS", "80")
    done = CliRunner().invoke(cli, ["conformance", "sampler:topk_no_temp", "-k", "distribution"])
    assert done.exit_code == 1, done.output
    lines = done.output.splitlines()
    assert max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]
    assert "FAILED distribution[pair-temperature+top_k]" in lines
    assert any("chi-square" in line for line in lines)
    assert any(line.startswith("not certified: the run did not pass") for line in lines)
