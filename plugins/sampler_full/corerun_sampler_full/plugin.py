"""Entry point of corerun-sampler-full: registers the ``full`` sampler (imports no torch)."""

from corerun import SamplerCapabilities, hookimpl

from corerun_sampler_full.options import FullSamplerOptions

HONOURED = frozenset(
    {
        "temperature", "seed", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "min_tokens", "logprobs", "prompt_logprobs", "logit_bias",
    }
)

# The one declaration of what ``full`` honours; ``FullSampler.capabilities`` is this object.
CAPABILITIES = SamplerCapabilities(params=HONOURED, logits_mask=True, draft_verification=True)


@hookimpl
def corerun_samplers(register):
    register(
        "full",
        "corerun_sampler_full.sampler:FullSampler",
        capabilities=CAPABILITIES,
        options=FullSamplerOptions,
        priority=10,
        description="vLLM's pipeline: logit bias, min_tokens, penalties, temperature, min-p, top-k, top-p, logprobs, seeds",
    )
