"""corerun's attention conformance suite against the ``flash`` backend, on CPU, through the flash-attn emulator.

This checks the backend's plumbing against the suite's own float64 reference (written apart from
these tests); it does not exercise flash-attn's CUDA kernels.  On a machine where flash-attn runs,
``corerun conformance attention:flash`` checks the real thing.
"""

from corerun.conformance import AttentionBackendSuite
from corerun_attention_flash.testing import emulated_capabilities, emulated_factory


class TestFlashFA2Emulated(AttentionBackendSuite):
    implementation = "flash-fa2-emulated"
    factory = staticmethod(emulated_factory("flash_attn"))
    capabilities = emulated_capabilities()
    device = "cpu"


class TestFlashFA3Emulated(AttentionBackendSuite):
    implementation = "flash-fa3-emulated"
    factory = staticmethod(emulated_factory("flash_attn_interface"))
    capabilities = emulated_capabilities()
    device = "cpu"
