"""The conformance report: alike failures in one block listing their cases, a one-line diagnosis per
failed check first, the full detail behind -v."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import corerun.plugin.registry as registry_module
from corerun import hookimpl
from corerun.cli import cli
from corerun.conformance.report import diagnose, group_failures
from corerun.conformance.runner import CheckResult
from corerun.plugin.registry import Registry
from tests.broken_impls.attention import WritesSlotPlusOne, factory


def result(check: str, case: str, outcome: str, reason: str = "") -> CheckResult:
    return CheckResult("attention", "mine", check, case, outcome, reason)


SHAPE = "output shape (4, 8, 64), expected (4, 8, 128)"


def test_identical_failures_are_one_group_and_a_gqa_mistake_is_named() -> None:
    cases = [f"{dt}-hd{hd}-bs16-{heads}" for dt in ("fp16", "bf16", "fp32") for hd in (64, 128) for heads in ("gqa1", "gqa4")]
    results = [result("decode", c, "failed" if c.endswith("gqa4") else "passed", SHAPE if c.endswith("gqa4") else "") for c in cases]
    results += [result("prefill", c, "failed", f"{c}: relative error rms {i}.5 (tolerance 0.004)") for i, c in enumerate(cases)]
    (shape, prefill) = group_failures(results)
    assert (shape.check, shape.reason, shape.identical) == ("decode", SHAPE, True)
    assert shape.cases == [c for c in cases if c.endswith("gqa4")]  # 6 failures, one block
    assert prefill.cases == cases and prefill.identical is False  # alike but for the case id and the figures
    assert diagnose(results) == [
        f"decode: 6 of 12 cases failed; {SHAPE}; only cases with gqa4 fail",
        "prefill: 12 of 12 cases failed; fp16-hd64-bs16-gqa1: relative error rms 0.5 (tolerance 0.004)",
    ]


def test_different_failures_stay_apart_and_the_diagnosis_counts_them() -> None:
    results = [result("kv_write", "a-bs16", "failed", "K: slot 3 not written"),
               result("kv_write", "b-bs16", "error", "RuntimeError: boom (at x.py:3)"),
               result("kv_write", "c-bs8", "passed")]
    assert [(g.outcome, g.cases) for g in group_failures(results)] == [("failed", ["a-bs16"]), ("error", ["b-bs16"])]
    assert diagnose(results) == ["kv_write: 2 of 3 cases failed; K: slot 3 not written (and 1 other failure); only cases with bs16 fail"]


@pytest.fixture()
def plusone(monkeypatch: pytest.MonkeyPatch) -> None:
    class Plugin:
        @hookimpl
        def corerun_attention_backends(self, register) -> None:
            register("plusone", factory(WritesSlotPlusOne))

    reg = Registry.from_environment(allow=[])
    reg.register_module(Plugin(), plugin="plusone", distribution="corerun-plusone", version="0.1")
    monkeypatch.setattr(registry_module, "_default", reg)
    monkeypatch.setenv("COLUMNS", "80")


def test_the_report_leads_with_the_diagnosis_and_keeps_detail_for_verbose(plusone: None) -> None:
    short = CliRunner().invoke(cli, ["conformance", "attention:plusone", "-k", "kv_write"])
    assert short.exit_code == 1, short.output
    lines = short.output.splitlines()
    assert lines.index("diagnosis") < next(i for i, line in enumerate(lines) if line.startswith("FAILED"))
    assert lines[lines.index("diagnosis") + 1].startswith("  kv_write: 4 of 4 cases failed; write_kv: K: ")
    blocks = [line for line in lines if line.startswith("FAILED")]  # four failing cases, two ways of failing
    assert blocks and all(b.startswith("FAILED kv_write, 2 cases alike: ") for b in blocks) and len(blocks) == 2
    assert any(line.startswith("  ... ") and line.endswith(("more line", "more lines")) for line in lines)
    whole = CliRunner().invoke(cli, ["conformance", "-v", "attention:plusone", "-k", "kv_write"])
    assert whole.exit_code == 1 and "more line" not in whole.output and "cut short" not in whole.output
    hidden = "must write nothing"  # the last line of each block: cut without -v, there with it
    assert whole.output.count(hidden) > short.output.count(hidden)
