"""corerun's own implementations pass the conformance suite, adopted the way a plugin adopts it."""

import pytest
import torch

from corerun.conformance import AttentionBackendSuite, GraphRunnerSuite, KVCacheManagerSuite, SamplerSuite


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The suites use tiny tensors: on a small shared CPU, intra-op threads only add contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
