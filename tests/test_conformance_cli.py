"""``corerun conformance KIND:NAME``: table / JSON output, -k selection, exit status."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
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
    assert "30 passed" in done.stdout and "deselected" in done.stdout, done.stdout


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


def _install(monkeypatch, hook: str, name: str, impl: type) -> None:
    """Register ``impl`` as the third-party implementation ``name`` (through the plugin hook ``hook``)
    in the process-wide registry, for this test only."""
    import corerun.plugin.registry as registry_module
    from corerun import hookimpl
    from corerun.plugin.registry import Registry

    def register_it(self, register) -> None:
        register(name, impl, capabilities=getattr(impl, "capabilities", None))

    plugin = type("Plugin", (), {hook: hookimpl(register_it)})()
    reg = Registry.from_environment(allow=[])
    reg.register_module(plugin, plugin=name, distribution=f"corerun-{name}", version="0.1")
    monkeypatch.setattr(registry_module, "_default", reg)


def test_failures_read_at_80_columns(monkeypatch) -> None:
    """A failing sampler's report: one block per failure naming check[case], wrapped to 80 columns."""
    from tests.broken_impls.sampler import IgnoresTemperatureWithTopK

    _install(monkeypatch, "corerun_samplers", "topk_no_temp", IgnoresTemperatureWithTopK)
    monkeypatch.setenv("COLUMNS", "80")
    done = CliRunner().invoke(cli, ["conformance", "sampler:topk_no_temp", "-k", "distribution"])
    assert done.exit_code == 1, done.output
    lines = done.output.splitlines()
    assert max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]
    assert "FAILED distribution[pair-temperature+top_k]" in lines
    assert any("chi-square" in line for line in lines)
    assert any(line.startswith("not certified: the run did not pass") for line in lines)


def _pytest_collects(tmp_path, *args: str) -> list[str]:
    """The test ids ``pytest --pyargs corerun.conformance ARGS --collect-only`` lists, run from an
    unrelated directory in a fresh interpreter (``Class::test[case]``)."""
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "corerun.conformance", "-p", "no:cacheprovider", "-q", "--collect-only", *args]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    return [line.split("test_selected.py::")[-1] for line in done.stdout.splitlines() if "::" in line]


@pytest.mark.parametrize(
    ("cli_args", "pytest_args"),
    [
        (["kv_cache:paged", "-k", "prefix and not bs16"], ["--corerun-impl", "kv_cache:paged", "-k", "prefix and not bs16"]),
        (["graph:eager", "--attention", "triton", "-k", "prefill_and_mixed and fp32"],
         ["--corerun-impl", "graph:eager", "--corerun-attention", "triton", "-k", "prefill_and_mixed and fp32"]),
    ],
    ids=["kv-cache-keyword", "graph-attention"],
)
def test_cli_runs_what_pytest_collects(tmp_path, cli_args: list[str], pytest_args: list[str]) -> None:
    """The command line and ``pytest --pyargs`` select the same tests: one collector."""
    done = CliRunner().invoke(cli, ["conformance", *cli_args, "--json"])
    assert done.exit_code == 0, done.output
    doc = json.loads(done.output)
    ran = [r["nodeid"].split("test_selected.py::")[-1] for r in doc["results"]]
    collected = _pytest_collects(tmp_path, *pytest_args)
    assert ran and ran == collected, (ran, collected)
    assert doc["pytest"].startswith("pytest --pyargs corerun.conformance --corerun-impl ")
    assert _pytest_collects(tmp_path, *shlex.split(doc["pytest"])[3:]) == collected  # the reported command reproduces it


def test_broken_implementation_fails_through_the_cli(monkeypatch) -> None:
    """A KV-cache manager that rewrites a held block table: exit status 1, naming exactly the failing test."""
    from tests.broken_impls.kv_cache import InsertsBeforeTail

    _install(monkeypatch, "corerun_kv_cache_managers", "rewrites_tables", InsertsBeforeTail)
    done = CliRunner().invoke(cli, ["conformance", "kv_cache:rewrites_tables", "--json"])
    assert done.exit_code == 1, done.output
    doc = json.loads(done.output)
    failed = {r["nodeid"] for r in doc["results"] if r["outcome"] == "failed"}
    configs = ("bs4-shared", "bs4-private", "bs16-shared", "bs16-private")  # (new_block_ids: the stated changes no longer replay)
    assert failed == {f"test_selected.py::TestKVCacheManager::test_{check}[{c}]" for check in ("block_tables_only_grow", "new_block_ids") for c in configs}
    assert doc["summary"]["passed"] == len(doc["results"]) - 8 > 0 and doc["ok"] is False and doc["certificate"] is None
    table = CliRunner().invoke(cli, ["conformance", "kv_cache:rewrites_tables", "-k", "block_tables_only_grow and bs4"])
    assert table.exit_code == 1, table.output
    assert "FAILED block_tables_only_grow, 2 cases alike: bs4-shared, bs4-private" in table.output  # one block
    assert "entries handed out must not change while the sequence holds blocks" in " ".join(table.output.split())


def test_a_collection_error_is_reported_not_raised() -> None:
    """A suite that cannot even be parametrised (pytest's collection error) comes back as one error naming why."""
    from corerun.conformance.runner import ResultCollector, invoke, pytest_args

    collector = ResultCollector("graph:eager")
    invoke(pytest_args("graph:eager", attention="nope", keyword="oversize"), collector)
    (only,) = collector.results
    assert only.outcome == "error" and only.failed and only.check == "collection"
    assert "no attention backend named 'nope'" in only.reason and only.nodeid.endswith("TestGraphRunner")
