"""corerun's own implementations pass the conformance suite, adopted the way a plugin adopts it."""


from corerun.conformance import AttentionBackendSuite, GraphRunnerSuite, KVCacheManagerSuite, SamplerSuite


class TestTorchAttention(AttentionBackendSuite):
    implementation = "torch"


class TestPagedKVCache(KVCacheManagerSuite):
    implementation = "paged"


class TestEagerGraphRunner(GraphRunnerSuite):
    implementation = "eager"


class TestCudaGraphRunner(GraphRunnerSuite):
    """Skipped, with the registry's reasons, where there is no CUDA device."""

    implementation = "cuda"


class TestBasicSampler(SamplerSuite):
    implementation = "basic"


class TestFullSampler(SamplerSuite):
    implementation = "full"
