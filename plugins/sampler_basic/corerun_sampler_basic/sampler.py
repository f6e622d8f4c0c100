"""The ``basic`` sampler: temperature scaling, greedy rows, exponential-race sampling, per-request seeds."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from corerun import ConfigError, SamplerCapabilities, UnsupportedError
from corerun.protocols import LogprobsTensors, SamplerOutput, SamplingMetadata
from corerun.sampling_params import SamplingParams
from corerun.sdk.sampling import GeneratorCache, check_logits, exponential_race, mark_non_finite, row_max, to_device
from corerun_sampler_basic.plugin import CAPABILITIES

FULL_HINT = "use `sampler: full` (built into corerun), which honours them"


class BasicSampler:
    """Greedy (``temperature == 0``) or softmax(logits / temperature) sampling, mixed freely in one batch.

    Honours ``temperature`` and ``seed``; :meth:`check` refuses every other sampling parameter.
    ``sample`` makes no host sync: per-request values become tensors once per step, and the random
    rows' draws are written into the greedy argmax with ``index_copy_``.  A row whose logits are not
    finite gets ``NON_FINITE``, read from the reductions that pick the tokens (the greedy max, the
    race's winning ``p / q``).
    """

    name: ClassVar[str] = "basic"
    capabilities: ClassVar[SamplerCapabilities] = CAPABILITIES

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", **options: Any) -> None:
        if options:
            raise ConfigError(f"sampler '{self.name}' takes no options, got {sorted(options)}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._generators = GeneratorCache()

    def check(self, params: SamplingParams) -> None:
        """Raise :class:`UnsupportedError` naming every parameter set that ``basic`` does not honour."""
        unsupported = self.capabilities.check(params)
        if unsupported:
            named = ", ".join(f"{field}={getattr(params, field)!r}" for field in unsupported)
            raise UnsupportedError(f"sampler '{self.name}'", [f"does not honour {named}", FULL_HINT])
        params.check_vocab(self.vocab_size)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """``logits`` float ``[B, V]`` (any float dtype; not modified) -> ``sampled_token_ids`` int64 ``[B]``."""
        check_logits(logits, metadata.batch_size, self.vocab_size)
        params = metadata.params
        greedy = [p.greedy for p in params]
        x = logits.to(torch.float32)
        if all(greedy):
            values, tokens = row_max(x)
            return SamplerOutput(mark_non_finite(tokens, values))
        # the race runs on the random rows only; ``seeded`` rows index into them
        rows = [i for i, g in enumerate(greedy) if not g]
        temperature = to_device([params[i].temperature for i in rows], torch.float32, x.device)
        seeded = [
            (j, params[i].seed, len(metadata.output_token_ids[i]))
            for j, i in enumerate(rows)
            if params[i].seed is not None
        ]
        generator = self._generators.get(x.device)
        if len(rows) == len(params):
            probs = torch.softmax(x / temperature[:, None], dim=-1)
            tokens = exponential_race(probs, seeded, generator)
            return SamplerOutput(mark_non_finite(tokens, probs.gather(1, tokens[:, None])[:, 0]))
        index = to_device(rows, torch.int64, x.device)
        probs = torch.softmax(x[index] / temperature[:, None], dim=-1)
        tokens = exponential_race(probs, seeded, generator)
        values, greedy_tokens = row_max(x)
        values.index_copy_(0, index, probs.gather(1, tokens[:, None])[:, 0])
        return SamplerOutput(mark_non_finite(greedy_tokens.index_copy_(0, index, tokens), values))

    def prompt_logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
        """Not provided by ``basic``: raises :class:`UnsupportedError`."""
        raise UnsupportedError(
            f"sampler '{self.name}'",
            [f"does not compute prompt logprobs (asked for {num_logprobs})",
             "use `sampler: full` (built into corerun), which does"],
        )
