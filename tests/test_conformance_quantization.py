"""The quantization suite passes the built-in gguf method and rejects each broken one."""

from __future__ import annotations

import pytest

from corerun.conformance.quantization_suite import QuantizationSuite
from corerun.quantization.capabilities import GGUF
from tests.broken_impls.quantization import IgnoresMinimum, ScalesOnWrongAxis, SwappedNibbles

pytest.importorskip("gguf")


class TestGGUF(QuantizationSuite):
    implementation = "gguf"


def _run(factory, check: str, type_name: str) -> None:
    class Suite(QuantizationSuite):
        pass

    Suite.factory, Suite.capabilities = factory, GGUF
    suite = Suite()
    target = Suite.resolve_targets()[0]
    from corerun.conformance.suite import Case

    getattr(suite, check)(Case(target, check, type_name, type_name, "cpu"))


@pytest.mark.parametrize(("broken", "type_name"), [
    (IgnoresMinimum, "Q4_1"), (SwappedNibbles, "Q4_0"), (SwappedNibbles, "Q4_1"), (ScalesOnWrongAxis, "Q8_0"),
])
@pytest.mark.parametrize("check", ["test_matmul", "test_merged", "test_odd_rows"])
def test_broken_methods_are_rejected(broken, type_name: str, check: str) -> None:
    with pytest.raises(AssertionError, match="off the float64 dequantize-then-matmul"):
        _run(broken, check, type_name)
