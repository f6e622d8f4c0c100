"""``corerun conformance`` on a plugin that fails to import: an error with the traceback's last line and
exit status 3, not "skipped" with 5 (the status of "no GPU here")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import corerun.plugin.registry as registry_module
from corerun.cli import cli
from corerun.cli.conformance import EXIT_IMPORT_FAILED, EXIT_NOTHING_RAN
from corerun.plugin.registry import LoadError, Registry
from tests.test_registry import Provides


def _use(monkeypatch: pytest.MonkeyPatch, reg: Registry) -> None:
    monkeypatch.setattr(registry_module, "_default", reg)


def test_a_kernel_module_that_fails_to_import_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_kernel_mod.py").write_text("import torch\nraise RuntimeError('kernel ABI mismatch: built for torch 9')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry.from_environment(allow=[])
    reg.register_module(Provides(sampler=[("brk", "broken_kernel_mod:Sampler", {})]), plugin="brk",
                        distribution="corerun-brk", version="0.3")
    _use(monkeypatch, reg)
    done = CliRunner().invoke(cli, ["conformance", "sampler:brk"])
    assert done.exit_code == EXIT_IMPORT_FAILED != EXIT_NOTHING_RAN, done.output
    assert "error: sampler:brk cannot be checked: its plugin fails to import" in done.output
    assert ("corerun-brk 0.3: import of broken_kernel_mod:Sampler failed: "
            "RuntimeError: kernel ABI mismatch: built for torch 9") in done.output
    assert "skipped" not in done.output
    sys.modules.pop("broken_kernel_mod", None)


def test_an_entry_point_that_fails_to_import_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = Registry.from_environment(allow=[])
    detail = 'Traceback (most recent call last):\n  File "plugin.py", line 3, in <module>\nNameError: name \'hookimpl\' is not defined\n'
    reg.load_errors.append(LoadError("mine", "corerun-attention-mine", "import of corerun_attention_mine.plugin failed: "
                                     "NameError: name 'hookimpl' is not defined", detail))
    _use(monkeypatch, reg)
    done = CliRunner().invoke(cli, ["conformance", "attention:mine"])
    assert done.exit_code == EXIT_IMPORT_FAILED, done.output
    assert ("plugin 'mine' (corerun-attention-mine): import of corerun_attention_mine.plugin failed: "
            "NameError: name 'hookimpl' is not defined") in done.output
    # an unknown name with every plugin importing is still a usage error
    _use(monkeypatch, Registry.from_environment(allow=[]))
    assert CliRunner().invoke(cli, ["conformance", "attention:mine"]).exit_code == 2
