"""The ``full`` sampler: vLLM v1's sampling pipeline, batched over requests with mixed parameters.

An all-greedy batch in which no row asks for logprobs, logit bias, ``min_tokens`` or a penalty takes
the argmax of the logits as they come (vLLM v1's shortcut: none of the stages could move it).
Otherwise, the order of operations for one step (``B`` rows, vocabulary ``V``)::

    raw logprobs = log_softmax(logits) in float32         (only if a row asks for logprobs)
    x = float32 copy of logits
    logit_bias; min_tokens (EOS and stop ids -> -inf)    processors.py
    repetition, frequency, presence penalties             penalties.py (histories: histories.py)
    greedy rows: argmax(x)
    x /= temperature (greedy rows: 1)
    min-p, top-k, top-p -> -inf                           truncation.py
    random rows: exponential race on softmax(x)           corerun.sampler.common (seeded rows: own generator)
    logprobs of the sampled token, its rank, the top-k    logprobs.py
    rows whose logits are not finite -> NON_FINITE        from the greedy max / the race's winning p/q

Every stage is one tensor pass over the batch; per-request values become tensors once per step from
the ``SamplingParams`` list, so nothing waits on the device (no ``.item()``, no branching on tensor values).
The penalties read each request's history from the metadata's lists (views of the runner's
persistent batch), so the sampler keeps no per-request state.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from corerun.plugin.capabilities import SamplerCapabilities
from corerun.errors import UnsupportedError
from corerun.protocols import LogprobsTensors, SamplerOutput, SamplingMetadata
from corerun.protocols.sampler import check_logits, mark_non_finite
from corerun.sampling_params import SAMPLING_EPS, SamplingParams

from corerun.sampler.logprobs import gather_logprobs
from corerun.sampler.argmax import row_max
from corerun.sampler.common import GeneratorCache, exponential_race, to_device
from corerun.sampler.penalties import apply_penalties
from corerun.sampler.options import CAPABILITIES, FullSamplerOptions
from corerun.sampler.processors import apply_logit_bias, apply_min_tokens
from corerun.sampler.truncation import apply_truncation


def _argmax_alone(p: SamplingParams) -> bool:
    """Whether row ``p`` is the argmax of its raw logits: greedy, and neither logprobs, logit bias,
    ``min_tokens`` nor a penalty (the stages that change the logits before the greedy choice).  Greedy is
    read from the temperature, as ``SamplingParams.greedy`` does, without a property call per row and step."""
    return (p.temperature < SAMPLING_EPS and p.logprobs is None and not p.logit_bias and not p.min_tokens
            and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0)


class FullSampler:
    """Honours every sampling parameter of :class:`~corerun.SamplingParams`; see the module docstring.

    ``options``: ``logprobs_mode`` (``raw``, the default, or ``processed``; see :class:`FullSamplerOptions`).
    """

    name: ClassVar[str] = "full"
    capabilities: ClassVar[SamplerCapabilities] = CAPABILITIES

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", **options: Any) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.options = FullSamplerOptions(**options)
        self._generators = GeneratorCache()

    def check(self, params: SamplingParams) -> None:
        """Raise :class:`UnsupportedError` for a parameter this sampler does not know; ``ValueError`` for ids outside the vocabulary."""
        unsupported = self.capabilities.check(params)
        if unsupported:
            named = ", ".join(f"{field}={getattr(params, field)!r}" for field in unsupported)
            raise UnsupportedError(f"sampler '{self.name}'", f"does not honour {named}")
        params.check_vocab(self.vocab_size)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """``logits`` float ``[B, V]`` (any float dtype; not modified) -> int64 ``[B]`` tokens and, if asked, logprobs."""
        check_logits(logits, len(metadata.params), self.vocab_size)
        params = metadata.params
        if all(map(_argmax_alone, params)):  # vLLM v1's all-greedy shortcut: no stage below can move the argmax
            values, tokens = row_max(logits)
            return SamplerOutput(mark_non_finite(tokens, values), None)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        raw = None
        if asked and self.options.logprobs_mode == "raw":
            raw = logits.log_softmax(dim=-1, dtype=torch.float32)

        x = logits.to(torch.float32, copy=True, memory_format=torch.contiguous_format)
        outputs = metadata.output_token_ids
        apply_logit_bias(x, [p.logit_bias for p in params])
        apply_min_tokens(
            x,
            [p.min_tokens for p in params],
            [len(o) for o in outputs],
            [metadata.eos_token_ids.union(p.stop_token_ids) if p.min_tokens else () for p in params],
        )
        apply_penalties(
            x,
            metadata.prompt_token_ids,
            outputs,
            [p.repetition_penalty for p in params],
            [p.frequency_penalty for p in params],
            [p.presence_penalty for p in params],
        )
        tokens, values = self._choose(x, metadata)

        logprobs = None
        if asked:
            source = raw if raw is not None else x.log_softmax(dim=-1)
            logprobs = gather_logprobs(source, tokens, max(asked))
        return SamplerOutput(mark_non_finite(tokens, values), logprobs)

    def prompt_logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
        """Raw logprobs of ``token_ids`` int ``[N]`` under ``logits`` float ``[N, V]``, their ranks, and the top ``num_logprobs``."""
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size or token_ids.shape != (logits.shape[0],):
            raise ValueError(
                f"prompt_logprobs needs logits [N, {self.vocab_size}] and token_ids [N], "
                f"got {list(logits.shape)} and {list(token_ids.shape)}"
            )
        if not 0 <= num_logprobs <= self.vocab_size:
            raise ValueError(f"num_logprobs must be in [0, {self.vocab_size}], got {num_logprobs}")
        return gather_logprobs(logits.log_softmax(dim=-1, dtype=torch.float32), token_ids, num_logprobs)

    def _choose(self, x: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy and random rows of the processed logits ``x`` -> (int64 ``[B]`` tokens, float ``[B]`` the
        value each row's token won with: finite exactly when the row's logits are); ``x`` ends as the
        logits sampled from."""
        params = metadata.params
        greedy = [p.greedy for p in params]
        if all(greedy):
            values, tokens = row_max(x)
            return tokens, values
        greedy_values, greedy_tokens = row_max(x) if any(greedy) else (None, None)
        temperature = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
        if any(t != 1.0 for t in temperature):
            x.div_(to_device(temperature, torch.float32, x.device)[:, None])
        apply_truncation(
            x,
            [0 if g else p.top_k for g, p in zip(greedy, params)],
            [1.0 if g else p.top_p for g, p in zip(greedy, params)],
            [0.0 if g else p.min_p for g, p in zip(greedy, params)],
        )
        # the race runs on the random rows only (noise is the costliest pass); ``seeded`` rows index into them
        random_rows = [i for i, g in enumerate(greedy) if not g]
        seeded = [
            (j, params[i].seed, len(metadata.output_token_ids[i]))
            for j, i in enumerate(random_rows)
            if params[i].seed is not None
        ]
        if greedy_tokens is None:
            probs = x.softmax(dim=-1)
            tokens = exponential_race(probs, seeded, self._generators.get(x.device))
            return tokens, probs.gather(1, tokens[:, None])[:, 0]
        index = to_device(random_rows, torch.int64, x.device)
        probs = x[index].softmax(dim=-1)
        tokens = exponential_race(probs, seeded, self._generators.get(x.device))
        values = greedy_values.index_copy_(0, index, probs.gather(1, tokens[:, None])[:, 0])
        return greedy_tokens.index_copy_(0, index, tokens), values
