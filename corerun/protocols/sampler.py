"""The ``Sampler`` protocol: logits for a batch of requests with mixed parameters -> next tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, Sequence, runtime_checkable

import torch

from corerun.plugin.capabilities import SamplerCapabilities
from corerun.sampling_params import SamplingParams

# The token a sampler returns for a row whose logits are not finite (a NaN or +inf anywhere, or -inf for
# every token): the runner ends that request with an error naming the cause; the other rows go on.
NON_FINITE = -1


def mark_non_finite(tokens: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``tokens`` (int64 ``[B]``) with :data:`NON_FINITE` where ``values`` (float ``[B]``) is not finite.
    ``values`` is a reduction the sampler made anyway: each row's greedy maximum (``max`` propagates
    NaN) or its race's winning ``p / q`` (a row of softmax over non-finite logits is all NaN).  Two
    elementwise passes over ``[B]``, no host sync."""
    return torch.where(values.isfinite(), tokens, NON_FINITE)


def check_logits(logits: torch.Tensor, batch_size: int, vocab_size: int) -> None:
    """Raise ``ValueError`` unless ``logits`` is a floating ``[batch_size, vocab_size]`` tensor."""
    if logits.dim() != 2 or tuple(logits.shape) != (batch_size, vocab_size) or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a float tensor [batch_size={batch_size}, vocab_size={vocab_size}], "
            f"got {logits.dtype} {list(logits.shape)}"
        )


@dataclass
class SamplingMetadata:
    """One step's sampling inputs; row ``i`` belongs to ``params[i]``.  Built once per step by the runner.

    - ``params``: the request's parameters (already accepted by ``Sampler.check``).
    - ``prompt_token_ids`` / ``output_token_ids``: the request's history (for penalties and
      ``min_tokens``); ``len(output_token_ids[i])`` is also the index of the token being drawn, which
      seeded requests use so that a seed gives the same tokens in any batch at any position.
    - ``eos_token_ids``: the model's end-of-sequence ids (masked until ``min_tokens`` is reached, with
      the request's ``stop_token_ids``).
    - ``seq_ids``: optional, one identity per row that stays the same for the whole life of a request
      and is never given to another request (the engine passes its ``seq_id``).  A sampler may key
      per-request state on it (a device copy of the prompt, the output history so far) so that a step
      costs in proportion to the new tokens rather than to the whole history.  A request's history only
      grows while it lives: its prompt never changes, and its output gains tokens at the end.  ``None``
      (the default, e.g. in conformance checks) means no identity: a sampler must then use the lists.
    - ``finished_seq_ids`` (protocol version 2): the seq_ids of requests finished or aborted since
      the previous ``sample`` call; they never come back, so a sampler drops their state now.  A
      request merely absent from a step (not scheduled, preempted, a prompt chunk that samples
      nothing) keeps its state: it may come back at the next step with its history grown by nothing
      or by the tokens it gained meanwhile.
    """

    params: Sequence[SamplingParams]
    prompt_token_ids: Sequence[Sequence[int]]
    output_token_ids: Sequence[Sequence[int]]
    eos_token_ids: frozenset[int] = frozenset()
    seq_ids: Sequence[int] | None = None
    finished_seq_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        n = len(self.params)
        keys = n if self.seq_ids is None else len(self.seq_ids)
        if len(self.prompt_token_ids) != n or len(self.output_token_ids) != n or keys != n:
            raise ValueError(
                f"SamplingMetadata rows disagree: {n} params, {len(self.prompt_token_ids)} prompts, "
                f"{len(self.output_token_ids)} outputs"
                + ("" if self.seq_ids is None else f", {len(self.seq_ids)} seq_ids")
            )

    @property
    def batch_size(self) -> int:
        return len(self.params)


@dataclass
class LogprobsTensors:
    """Logprobs of a batch, vLLM's layout.

    - ``token_ids`` int64 ``[B, 1 + k]``: column 0 is the sampled (or prompt) token, then the top-k.
    - ``logprobs`` float32 ``[B, 1 + k]``: their log-probabilities.
    - ``ranks`` int64 ``[B]``: rank of the column-0 token in its row (1 = most likely).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


@dataclass
class SamplerOutput:
    """``sampled_token_ids`` int64 ``[B]``; ``logprobs`` when any row asked for them (rows that did not are padding).

    A row whose logits are not finite (a NaN or ``+inf`` anywhere, or ``-inf`` for every token) gets
    ``corerun.sdk.sampling.NON_FINITE`` (-1) instead of a token id; every other row gets an id in
    ``[0, vocab_size)``, a row partly ``-inf`` (a logits processor's mask) included.  The engine ends the
    marked rows' requests with ``finish_reason "error"`` and takes no token or logprob from them.
    ``corerun.sdk.sampling.mark_non_finite(tokens, values)`` does it from a reduction the sampler makes
    anyway (the greedy ``max``, the draw's winning probability); the conformance check ``non_finite``
    holds every sampler to it.
    """

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None = None


@runtime_checkable
class Sampler(Protocol):
    """Factory signature: ``factory(vocab_size: int, device: torch.device, **options) -> Sampler``."""

    name: ClassVar[str]
    capabilities: ClassVar[SamplerCapabilities]

    def check(self, params: SamplingParams) -> None:
        """Raise :class:`corerun.errors.UnsupportedError` naming each parameter this sampler cannot honour."""
        ...

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """``logits`` float ``[B, vocab_size]`` (any float dtype) -> next tokens, without a host sync."""
        ...

    def prompt_logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
        """Logprobs of ``token_ids`` ``[N]`` under ``logits`` ``[N, V]`` (row j predicts token j) with the top ``num_logprobs``."""
        ...
