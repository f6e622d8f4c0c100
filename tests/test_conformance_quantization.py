"""The quantization suite passes the built-in methods (gguf, gptq, awq, compressed-tensors, fp8) and rejects each broken one."""

from __future__ import annotations

import pytest

from corerun.conformance.quantization_suite import QuantizationSuite
from corerun.quantization.capabilities import AWQ, COMPRESSED_TENSORS, FP8, GGUF, GPTQ
from tests.broken_impls.quantization import (
    AWQInOrder, CompressedScalesTransposed, FP8ScaleIgnored, GPTQZerosAsStored, IgnoresMinimum, ScalesOnWrongAxis, SwappedNibbles,
)

pytest.importorskip("gguf")


class TestGGUF(QuantizationSuite):
    implementation = "gguf"


class TestGPTQ(QuantizationSuite):
    implementation = "gptq"


class TestAWQ(QuantizationSuite):
    implementation = "awq"


class TestCompressedTensors(QuantizationSuite):
    implementation = "compressed-tensors"


class TestFP8(QuantizationSuite):
    implementation = "fp8"


def _run(factory, check: str, type_name: str, capabilities=GGUF) -> None:
    class Suite(QuantizationSuite):
        pass

    Suite.factory, Suite.capabilities = factory, capabilities
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


@pytest.mark.parametrize(("broken", "capabilities", "fmt"), [
    (GPTQZerosAsStored, GPTQ, "gptq-4bit-g32"), (AWQInOrder, AWQ, "awq-4bit-g32"),
    (CompressedScalesTransposed, COMPRESSED_TENSORS, "ct-w4a16-g32"), (FP8ScaleIgnored, FP8, "fp8-tensor"),
])
@pytest.mark.parametrize("check", ["test_matmul", "test_sharded"])
def test_broken_packed_methods_are_rejected(broken, capabilities, fmt: str, check: str) -> None:
    with pytest.raises(AssertionError, match="off the float64 dequantize-then-matmul"):
        _run(broken, check, fmt, capabilities)
