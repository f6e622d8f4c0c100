"""The shared conformance suite, adopted the way any plugin adopts it (the sampled matrix; the full
matrix runs with ``corerun conformance attention:cpu --full-matrix``)."""

from corerun.conformance import AttentionBackendSuite


class TestCpuConformance(AttentionBackendSuite):
    implementation = "cpu"
