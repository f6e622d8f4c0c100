"""The ``options:`` the ``full`` sampler takes in a corerun config (plain pydantic, no torch)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class FullSamplerOptions(BaseModel):
    """``sampler: {name: full, options: {logprobs_mode: processed}}``.

    - ``logprobs_mode``: ``raw`` (default, as vLLM): logprobs are ``log_softmax`` of the model's logits,
      before any sampling parameter; ``processed``: ``log_softmax`` of the logits the token was drawn
      from (after logit bias, min_tokens, penalties, temperature, min-p, top-k and top-p; greedy rows:
      before temperature).  Prompt logprobs are always raw.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    logprobs_mode: Literal["raw", "processed"] = "raw"
