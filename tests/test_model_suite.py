"""``corerun conformance model:ARCH``: the built-in families pass against transformers in float64; broken ones fail."""

from __future__ import annotations

import pytest

from corerun.conformance import run
from tests.broken_impls.model import MissedNorm, TransposedWeight, WrongRotaryVariant

CHECKS = {"weights", "prefill", "chunked_prefill", "prefix_decode", "greedy", "preemption"}


def _outcomes(results: list) -> dict[str, str]:
    return {f"{r.check}[{r.case}]": r.outcome for r in results}


@pytest.mark.timeout(600)
def test_llama_passes_every_check_and_shape() -> None:
    results = run("model", "LlamaForCausalLM")
    ran = [r for r in results if r.check != "tensor_parallel"]  # two processes: only with the full matrix
    assert {r.check for r in ran} == CHECKS
    assert {r.case for r in ran} == {"gqa-untied", "mha-tied", "mqa-untied"}
    assert [k for k, v in _outcomes(ran).items() if v != "passed"] == []
    assert {r.outcome for r in results if r.check == "tensor_parallel"} == {"skipped"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_builtin_family_passes(arch: str) -> None:
    results = run("model", arch, keyword="gqa-untied or (prefill and mha-tied)")
    assert len(results) == len(CHECKS) + 2
    assert [k for k, v in _outcomes(results).items() if v != "passed"] == []


@pytest.mark.timeout(600)
@pytest.mark.parametrize("broken", [WrongRotaryVariant, TransposedWeight, MissedNorm], ids=lambda c: c.__name__)
def test_broken_family_rejected(broken: type) -> None:
    results = run("model", factory=broken, keyword="gqa-untied and (prefill or weights or greedy)")
    got = {r.check: r for r in results}
    assert got["weights"].outcome == "passed"  # each loads every tensor: only the logits show the fault
    assert got["prefill"].outcome == "failed"
    assert "differ from transformers" in got["prefill"].reason
    assert got["greedy"].outcome == "failed"

