"""Entry point of corerun-sampler-basic: registers the ``basic`` sampler (imports no torch)."""

from corerun import SamplerCapabilities, hookimpl

# The one declaration of what ``basic`` honours; ``BasicSampler.capabilities`` is this object.
CAPABILITIES = SamplerCapabilities(params=frozenset({"temperature", "seed"}), logits_mask=True, draft_verification=True)


@hookimpl
def corerun_samplers(register):
    register(
        "basic",
        "corerun_sampler_basic.sampler:BasicSampler",
        capabilities=CAPABILITIES,
        description="temperature scaling and greedy; exponential-race sampling",
    )
