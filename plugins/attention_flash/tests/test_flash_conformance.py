"""The conformance hook: ``corerun.conformance`` runs against the ``flash`` backend on CPU, through the emulator.

These run the suite's cheap checks (cache layout, write_kv, CUDA-graph padding rows, refusal of
undeclared specs) for both the FA2 and FA3 emulations, which shows the hook plugs into the suite.
The whole suite passes too (86 cases), but its float64 reference over 256/512-token blocks takes
about a quarter of an hour on two CPU cores, so it is run on demand::

    from corerun.conformance import run
    from corerun_attention_flash.testing import emulated_capabilities, emulated_factory

    results = run("attention", "flash-fa2-emulated", factory=emulated_factory("flash_attn"),
                  capabilities=emulated_capabilities(), device="cpu")

None of this exercises flash-attn's CUDA kernels; ``corerun conformance attention:flash`` on a GPU
machine with flash-attn installed does.
"""

from __future__ import annotations

import pytest

from corerun.conformance import run
from corerun_attention_flash.testing import emulated_capabilities, emulated_factory

FAST_CHECKS = "(cache_layout or kv_write or padding_slots) and hd64-bs256 or unsupported"


@pytest.mark.parametrize("library", ["flash_attn", "flash_attn_interface"])
def test_suite_fast_checks_pass_under_emulation(library):
    results = run(
        "attention", f"flash-{library}-emulated", factory=emulated_factory(library),
        capabilities=emulated_capabilities(), device="cpu", keyword=FAST_CHECKS,
    )
    outcomes = {r.id: r.outcome for r in results}
    assert sorted({r.check for r in results}) == ["cache_layout", "kv_write", "padding_slots", "unsupported"], outcomes
    failed = {r.id: r.reason for r in results if r.outcome != "passed"}
    assert not failed, failed
    refused = sorted(r.case for r in results if r.check == "unsupported")
    assert refused == ["bs8", "dtype-fp32", "hd320"]


def test_emulated_factory_builds_outside_the_context():
    """A backend built by the factory keeps working after the emulation context has been left."""
    import torch

    from corerun.errors import UnsupportedError
    from corerun.protocols.attention import AttentionSpec
    from corerun_attention_flash.backend import FlashAttentionBackend

    spec = AttentionSpec(num_heads=4, num_kv_heads=1, head_size=64, dtype=torch.float16, block_size=256, device=torch.device("cpu"))
    backend = emulated_factory()(spec)
    assert backend.library.endswith("(FA2)") and "emulator" in backend.library
    assert "cpu" in emulated_capabilities().devices and "cpu" not in FlashAttentionBackend.capabilities.devices
    with pytest.raises(UnsupportedError, match="device cpu not in"):
        FlashAttentionBackend(spec)
