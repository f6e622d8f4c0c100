"""The LoRA kernel suite passes the built-in kernels and rejects each broken one."""

from __future__ import annotations

import pytest

from corerun.conformance.lora_suite import LoRAKernelSuite
from corerun.conformance.suite import Case
from tests.broken_impls.lora import AppliesToBaseTokens, IgnoresScaling, Overwrites, SwapsSlices, TransposesB


class TestTorch(LoRAKernelSuite):
    implementation = "torch"


class TestGrouped(LoRAKernelSuite):
    implementation = "grouped"


def _run(factory, check: str, case_id: str) -> None:
    class Suite(LoRAKernelSuite):
        pass

    Suite.factory = factory
    suite, target = Suite(), Suite.resolve_targets()[0]
    config = dict(suite.configs(check, target, full=False))[case_id]
    getattr(suite, f"test_{check}")(Case(target, check, case_id, config, "cpu"))


@pytest.mark.parametrize("broken", [IgnoresScaling, AppliesToBaseTokens, SwapsSlices, TransposesB, Overwrites])
@pytest.mark.parametrize(("check", "case_id"), [("mixed", "fp32-qkv"), ("mixed", "bf16-gate_up"), ("large", "fp32")])
def test_broken_kernels_are_rejected(broken, check: str, case_id: str) -> None:
    with pytest.raises(AssertionError, match="slot -1|merged-weights product"):
        _run(broken, check, case_id)


@pytest.mark.parametrize(("broken", "check"), [(AppliesToBaseTokens, "base_only"), (Overwrites, "one_token")])
def test_broken_kernels_fail_the_narrow_checks(broken, check: str) -> None:
    with pytest.raises(AssertionError, match="slot -1|merged-weights product"):
        _run(broken, check, "fp32")
