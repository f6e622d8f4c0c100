"""The small things a new user or plugin author meets in the first hour: a mistyped plugin option gets
a did-you-mean, the sampler scaffold serves masked (structured-output) requests, ``corerun --help`` and
``corerun new --help`` list the same kinds (every plugin kind), and the by-hand plugin of
docs/conformance.md imports only public API and passes."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from corerun.plugin.capabilities import SamplerCapabilities
from corerun.cli import cli
from corerun.errors import PluginError
from corerun.plugin.registry import KINDS, Registry
from corerun.scaffold import scaffold
from tests.test_plugin_imports import is_public
from tests.test_registry import Provides, Recorder

ROOT = Path(__file__).resolve().parents[1]


def test_a_mistyped_option_gets_a_did_you_mean() -> None:
    from pydantic import BaseModel, ConfigDict

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        num_splits: int = 1
        block_n: int = 64

    reg = Registry()
    reg.register_module(Provides(attention=[("mine", Recorder(), {"options": Options})]), plugin="mine",
                        distribution="corerun-mine", version="1.0")
    with pytest.raises(PluginError) as info:
        reg.get("attention", "mine").validate_options({"num_split": 4}, "attention")
    assert str(info.value) == (
        "invalid options for attention backend 'mine': attention.options.num_split: Extra inputs are not permitted "
        "(got 4) (did you mean 'num_splits'?; options are block_n, num_splits)"
    )
    with pytest.raises(PluginError, match=r"options.zzz: .*\(options are block_n, num_splits\)$"):
        reg.get("attention", "mine").validate_options({"zzz": 4}, "attention")


def test_the_sampler_scaffold_declares_logits_mask_and_honours_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = scaffold("sampler", "masky", tmp_path)
    monkeypatch.syspath_prepend(str(root))
    from corerun_sampler_masky.plugin import CAPABILITIES
    from corerun_sampler_masky.sampler import Sampler

    assert isinstance(CAPABILITIES, SamplerCapabilities) and CAPABILITIES.logits_mask is True
    from corerun.conformance import run

    results = run("sampler", factory=Sampler, capabilities=CAPABILITIES, name="masky", keyword="masked_logits")
    assert results and all(r.outcome == "passed" for r in results), [(r.id, r.reason) for r in results]
    for module in [m for m in sys.modules if m.startswith("corerun_sampler_masky")]:
        monkeypatch.delitem(sys.modules, module)


def test_help_and_new_help_list_every_plugin_kind() -> None:
    top = " ".join(CliRunner().invoke(cli, ["--help"], terminal_width=200).output.split())
    listed = re.search(r"corerun new (\S+) NAME", top)
    assert listed is not None, top
    new_help = " ".join(CliRunner().invoke(cli, ["new", "--help"], terminal_width=200).output.split())
    choice = re.search(r"\{([a-z_|]+)\}", new_help)
    assert choice is not None, new_help
    assert listed.group(1).split("|") == choice.group(1).split("|")
    assert sorted(choice.group(1).split("|")) == sorted(KINDS)  # every kind a plugin can provide


def _code_after(text: str, marker: str) -> str:
    block = text[text.index(marker):]
    return block[block.index("```python\n") + len("```python\n"):block.index("\n```", block.index("```python"))]


def test_the_by_hand_plugin_of_the_conformance_doc_uses_public_api_and_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = (ROOT / "docs" / "conformance.md").read_text()
    package = tmp_path / "corerun_attention_mine"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("plugin", "backend"):
        code = _code_after(doc, f"`corerun_attention_mine/{name}.py`")
        imported = [n.module for n in ast.walk(ast.parse(code)) if isinstance(n, ast.ImportFrom)]
        assert imported and all(is_public(m) for m in imported), imported
        (package / f"{name}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    from corerun_attention_mine.backend import MyAttentionBackend
    from corerun_attention_mine.plugin import CAPABILITIES
    from corerun.conformance import run

    results = run("attention", factory=MyAttentionBackend, capabilities=CAPABILITIES, name="mine",
                  keyword="(decode and fp32) or unsupported")
    assert {r.check for r in results} == {"decode", "unsupported"}
    assert all(r.outcome == "passed" for r in results), [(r.id, r.reason) for r in results if r.outcome != "passed"]
    for module in [m for m in sys.modules if m.startswith("corerun_attention_mine")]:
        monkeypatch.delitem(sys.modules, module)
