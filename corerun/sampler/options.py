"""What the ``full`` sampler declares to the registry: its capabilities and the ``options:`` it takes
in a corerun config (plain pydantic, no torch: :mod:`corerun.plugin.builtin` imports this module)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from corerun.plugin.capabilities import SamplerCapabilities

HONOURED = frozenset(
    {
        "temperature", "seed", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "min_tokens", "logprobs", "prompt_logprobs", "logit_bias",
    }
)

# The one declaration of what ``full`` honours; ``FullSampler.capabilities`` is this object.
CAPABILITIES = SamplerCapabilities(params=HONOURED, logits_mask=True, draft_verification=True)


class FullSamplerOptions(BaseModel):
    """``sampler: {name: full, options: {logprobs_mode: processed}}``.

    - ``logprobs_mode``: ``raw`` (default, as vLLM): logprobs are ``log_softmax`` of the model's logits,
      before any sampling parameter; ``processed``: ``log_softmax`` of the logits the token was drawn
      from (after logit bias, min_tokens, penalties, temperature, min-p, top-k and top-p; greedy rows:
      before temperature).  Prompt logprobs are always raw.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    logprobs_mode: Literal["raw", "processed"] = "raw"
