"""``pytest --pyargs corerun.conformance --corerun-impl KIND:NAME`` (the raw-pytest route) on a plugin
that fails to import: a collection error naming the failure with its traceback's last line, exit
status 2, as pytest treats a test module that fails to import; not "skipped" with 5 (no GPU here)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import corerun.conformance as package
import corerun.plugin.registry as registry_module
from corerun.conformance import run
from corerun.plugin.registry import LoadError, Registry
from tests.test_registry import Provides

ISOLATED = ["-c", os.devnull, "--rootdir", os.path.dirname(package.__file__), "--noconftest",
            "--import-mode=importlib", "-p", "no:cacheprovider", "-p", "corerun"]


def _raw_pytest(impl: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    code = pytest.main([*ISOLATED, "--pyargs", "corerun.conformance", "--corerun-impl", impl, "-k", "greedy"])
    captured = capsys.readouterr()
    return int(code), captured.out + captured.err


@pytest.fixture
def broken_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Registry:
    (tmp_path / "broken_sampler_kernel.py").write_text("import torch\nraise RuntimeError('kernel ABI mismatch: built for torch 9')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry.from_environment(allow=[])
    reg.register_module(Provides(sampler=[("brk", "broken_sampler_kernel:Sampler", {})]), plugin="brk",
                        distribution="corerun-brk", version="0.3")
    monkeypatch.setattr(registry_module, "_default", reg)
    yield reg
    sys.modules.pop("broken_sampler_kernel", None)


def test_a_kernel_module_that_fails_to_import_is_a_collection_error(broken_kernel: Registry, capsys: pytest.CaptureFixture[str]) -> None:
    code, output = _raw_pytest("sampler:brk", capsys)
    assert code == pytest.ExitCode.INTERRUPTED != pytest.ExitCode.NO_TESTS_COLLECTED, output
    assert "sampler:brk cannot be checked: its plugin fails to import" in output
    assert ("corerun-brk 0.3: import of broken_sampler_kernel:Sampler failed: "
            "RuntimeError: kernel ABI mismatch: built for torch 9") in output
    assert "1 error" in output and "skipped" not in output


def test_the_programmatic_runner_reports_it_as_an_error(broken_kernel: Registry) -> None:
    (result,) = run("sampler", "brk", keyword="greedy")
    assert result.outcome == "error" and result.check == "collection"
    assert "RuntimeError: kernel ABI mismatch: built for torch 9" in result.reason


def test_an_entry_point_that_fails_to_import_is_a_collection_error(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    reg = Registry.from_environment(allow=[])
    detail = 'Traceback (most recent call last):\n  File "plugin.py", line 3, in <module>\nNameError: name \'hookimpl\' is not defined\n'
    reg.load_errors.append(LoadError("mine", "corerun-sampler-mine", "import of corerun_sampler_mine.plugin failed: "
                                     "NameError: name 'hookimpl' is not defined", detail))
    monkeypatch.setattr(registry_module, "_default", reg)
    code, output = _raw_pytest("sampler:mine", capsys)
    assert code == pytest.ExitCode.INTERRUPTED, output
    assert ("plugin 'mine' (corerun-sampler-mine): import of corerun_sampler_mine.plugin failed: "
            "NameError: name 'hookimpl' is not defined") in output


def test_a_sampler_that_imports_still_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code, output = _raw_pytest("sampler:basic", capsys)
    assert code == pytest.ExitCode.OK and "cannot be checked" not in output, output
