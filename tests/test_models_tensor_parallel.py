"""The model suite's ``tensor_parallel`` check (two gloo processes, opted into with ``--full-matrix``):
Gemma 2 split over two ranks gives the single-process logits; a family that forgets the all-reduce of
its row-parallel layers is rejected; without the full matrix the check is skipped, saying how to run it."""

from __future__ import annotations

from typing import Any

import pytest

from corerun.conformance import run
from corerun.models.llama import LlamaForCausalLM
from corerun.plugin.capabilities import ModelCapabilities


class _NoReduce:
    """A tensor-parallel group whose all-reduce does nothing (each rank keeps its partial sums)."""

    def __init__(self, tp: Any) -> None:
        self._tp = tp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tp, name)

    def all_reduce(self, x: Any) -> Any:
        return x


class ForgetsAllReduce(LlamaForCausalLM):
    """Broken: o_proj and down_proj never sum the ranks' partial products."""

    hf_architecture = "LlamaForCausalLM"

    def __init__(self, config: Any, tp: Any = None, quant: Any = None) -> None:
        super().__init__(config, None if tp is None else _NoReduce(tp), quant)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tensor_parallel_check_passes_gemma2_and_rejects_a_missing_all_reduce() -> None:
    (good,) = run("model", "Gemma2ForCausalLM", keyword="tensor_parallel", full_matrix=True)
    assert good.outcome == "passed", good.reason
    (bad,) = run("model", factory=ForgetsAllReduce, capabilities=ModelCapabilities(tensor_parallel=True),
                 keyword="tensor_parallel", full_matrix=True)
    assert bad.outcome == "failed" and "two tensor-parallel ranks" in bad.reason and "differ" in bad.reason, bad.reason


def test_tensor_parallel_check_is_opt_in() -> None:
    (result,) = run("model", "LlamaForCausalLM", keyword="tensor_parallel", full_matrix=False)
    assert result.outcome == "skipped" and "--full-matrix" in result.reason
    (undeclared,) = run("model", factory=ForgetsAllReduce, keyword="tensor_parallel", full_matrix=True)
    assert undeclared.outcome == "skipped" and "does not declare tensor_parallel" in undeclared.reason
