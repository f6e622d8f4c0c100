"""The attention suite's kv_cache_dtype check: passes the torch reference on every format it declares, makes a
backend that declares none refuse them, and rejects quantized caches that drop the scale, skip the rounding
or round the wrong way."""

from __future__ import annotations

import pytest

from corerun.attention.torch_backend import TorchAttentionBackend
from corerun.conformance import run
from tests.broken_impls.attention import NaiveAttentionBackend
from tests.broken_impls.kv_quant_attention import ReadsWithoutScale, RoundsTowardZero, StoresUnquantized

FORMATS = {"fp8_e4m3", "fp8_e5m2", "int8"}


def _outcomes(factory: type) -> dict[str, tuple[str, str]]:
    results = run("attention", factory=factory, keyword="kv_cache_dtype")
    return {r.case.split("-")[0]: (r.outcome, r.reason or "") for r in results}


@pytest.mark.timeout(60)
def test_torch_reference_passes_every_format() -> None:
    outcomes = _outcomes(TorchAttentionBackend)
    assert set(outcomes) == FORMATS
    assert all(o == "passed" for o, _ in outcomes.values()), outcomes


def test_a_backend_declaring_no_format_refuses_them() -> None:
    outcomes = _outcomes(NaiveAttentionBackend)
    assert {k: o for k, (o, _) in outcomes.items()} == dict.fromkeys(FORMATS, "passed")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", [ReadsWithoutScale, StoresUnquantized, RoundsTowardZero],
                         ids=["reads-without-scale", "stores-unquantized", "rounds-toward-zero"])
def test_broken_quantized_cache_rejected(impl: type) -> None:
    outcomes = _outcomes(impl)
    assert {k: o for k, (o, _) in outcomes.items()} == dict.fromkeys(FORMATS, "failed")
    assert all("against attention over the reference-rounded" in why for _, why in outcomes.values())
