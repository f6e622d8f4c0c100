"""Entry point of corerun-sampler-basic: registers the ``basic`` sampler (imports no torch)."""

from corerun import SamplerCapabilities, hookimpl


@hookimpl
def corerun_samplers(register):
    register(
        "basic",
        "corerun_sampler_basic.sampler:BasicSampler",
        capabilities=SamplerCapabilities(params=frozenset({"temperature", "seed"})),
        description="temperature scaling and greedy; exponential-race sampling",
    )
