"""Small correct samplers (temperature / top-k / top-p, penalties) and broken variants of them."""

from __future__ import annotations

from typing import ClassVar

import torch

from corerun.plugin.capabilities import SamplerCapabilities
from corerun.errors import UnsupportedError
from corerun.protocols.sampler import LogprobsTensors, SamplerOutput, SamplingMetadata
from corerun.sampling_params import SamplingParams
from corerun.sdk.sampling import mark_non_finite


class TopPSampler:
    """Correct: temperature, then top-k, then top-p on the renormalised top-k distribution; multinomial draw.
    A row whose raw maximum is not finite (a NaN or ``+inf`` anywhere, ``-inf`` everywhere) is NON_FINITE."""

    name: ClassVar[str] = "top-p-sampler"
    capabilities: ClassVar[SamplerCapabilities] = SamplerCapabilities(params=frozenset({"temperature", "top_k", "top_p"}))
    temperature_factor: ClassVar[float] = 1.0

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device

    def check(self, params: SamplingParams) -> None:
        missing = self.capabilities.check(params)
        if missing:
            raise UnsupportedError(f"sampler '{self.name}'", [f"{name} is not supported" for name in missing])

    def _temperatures(self, params: list[SamplingParams]) -> list[float]:
        return [p.temperature for p in params]

    def _top_p(self, x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        ascending, order = x.sort(dim=-1)
        mass_up_to = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = mass_up_to <= (1 - top_p)[:, None]
        drop[:, -1] = False
        return x.scatter(1, order, ascending.masked_fill(drop, float("-inf")))

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        params = metadata.params
        x = logits.float()
        values, greedy_tokens = x.max(dim=-1)  # max propagates NaN: not finite exactly on the unusable rows
        temps = torch.tensor(self._temperatures(params), device=x.device) * self.temperature_factor
        x = x / torch.where(temps > 0, temps, torch.ones_like(temps))[:, None]
        ks = torch.tensor([p.top_k if 0 < p.top_k < x.shape[1] else x.shape[1] for p in params], device=x.device)
        kth = x.sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
        x = self._top_p(x, torch.tensor([p.top_p for p in params], device=x.device, dtype=x.dtype))
        probs = torch.where(values.isfinite()[:, None], x.softmax(dim=-1), 1.0)  # multinomial refuses NaN rows
        drawn = torch.multinomial(probs, 1).squeeze(1)
        return SamplerOutput(self._mark(torch.where(temps > 0, drawn, greedy_tokens), values))

    def _mark(self, tokens: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return mark_non_finite(tokens, values)

    def prompt_logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
        lp = logits.float().log_softmax(dim=-1)
        chosen = lp.gather(1, token_ids[:, None])
        top = lp.topk(num_logprobs, dim=-1)
        ranks = (lp > chosen).sum(dim=-1) + 1
        return LogprobsTensors(torch.cat([token_ids[:, None], top.indices], 1), torch.cat([chosen, top.values], 1), ranks)


class UnmarkedArgmax(TopPSampler):
    """Broken: never marks a row NON_FINITE, so a greedy row of NaN logits comes back as the plain
    argmax (token 0, or wherever the NaN is) and a random one as whatever the draw gave."""

    name = "unmarked-argmax"

    def _mark(self, tokens: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return tokens


class IgnoresTopP(TopPSampler):
    """Broken: accepts top_p (declares it) but never applies it."""

    name = "ignores-top-p"

    def _top_p(self, x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        return x


class TopKSampler(TopPSampler):
    """Correct: temperature and top-k only (declares no top-p or min-p, so no single-parameter case of
    the suite combines temperature with top-k)."""

    name = "top-k-sampler"
    capabilities = SamplerCapabilities(params=frozenset({"temperature", "top_k"}))


class IgnoresTemperatureWithTopK(TopKSampler):
    """Broken: drops the temperature of any random row that also sets ``top_k``."""

    name = "ignores-temperature-with-top-k"

    def _temperatures(self, params: list[SamplingParams]) -> list[float]:
        return [1.0 if p.top_k > 0 and p.temperature > 0 else p.temperature for p in params]


class NeverSamplesLastId(TopPSampler):
    """Broken: an off-by-one on the vocabulary: the last token id can never be drawn (or chosen greedily)."""

    name = "never-samples-last-id"

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.clone()
        logits[:, -1] = float("-inf")
        return super().sample(logits, metadata)


class TemperatureOff(TopPSampler):
    """Broken: divides by 1.5 x the requested temperature."""

    name = "temperature-off"
    temperature_factor = 1.5


class PenaltySampler(TopPSampler):
    """Correct: repetition, frequency and presence penalties from the step's lists (dense counts), then
    temperature, top-k and top-p as :class:`TopPSampler`."""

    name = "dense-counts"
    capabilities = SamplerCapabilities(
        params=frozenset({"temperature", "top_k", "top_p", "repetition_penalty", "frequency_penalty", "presence_penalty"})
    )

    def _histories(self, metadata: SamplingMetadata) -> tuple[list[list[int]], list[list[int]]]:
        return [list(p) for p in metadata.prompt_token_ids], [list(o) for o in metadata.output_token_ids]

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        prompts, outputs = self._histories(metadata)
        batch, vocab = logits.shape
        dev = logits.device

        def counts(seqs: list[list[int]]) -> torch.Tensor:
            width = max(1, max(len(s) for s in seqs))
            padded = torch.tensor([s + [vocab] * (width - len(s)) for s in seqs], device=dev)
            return torch.zeros(batch, vocab + 1, device=dev).scatter_add_(1, padded, torch.ones(padded.shape, device=dev))[:, :vocab]

        col = lambda values: torch.tensor(values, dtype=torch.float32, device=dev)[:, None]  # noqa: E731
        params = metadata.params
        out_counts = counts(outputs)
        seen = (counts(prompts) > 0) | (out_counts > 0)
        rep = torch.where(seen, col([p.repetition_penalty for p in params]), 1.0)
        x = logits.float()
        x = torch.where(x > 0, x / rep, x * rep)
        x = x - col([p.frequency_penalty for p in params]) * out_counts - col([p.presence_penalty for p in params]) * (out_counts > 0)
        return super().sample(x, metadata)


class StaleHistory(PenaltySampler):
    """Broken: keeps each request's history by ``seq_id`` from the first step it sees it, and never
    refreshes the output (steps without ``seq_ids`` read the lists, so every other check passes)."""

    name = "stale-history"

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__(vocab_size, device)
        self._cache: dict[int, tuple[list[int], list[int]]] = {}

    def _histories(self, metadata: SamplingMetadata) -> tuple[list[list[int]], list[list[int]]]:
        if metadata.seq_ids is None:
            return super()._histories(metadata)
        for seq_id, prompt, output in zip(metadata.seq_ids, metadata.prompt_token_ids, metadata.output_token_ids):
            self._cache.setdefault(seq_id, (list(prompt), list(output)))
        return [self._cache[s][0] for s in metadata.seq_ids], [self._cache[s][1] for s in metadata.seq_ids]


class MaskedTopPSampler(TopPSampler):
    """Correct, and declares ``logits_mask``: a ``-inf`` logit has probability 0 in every step above."""

    name = "masked-top-p-sampler"
    capabilities = SamplerCapabilities(params=frozenset({"temperature", "top_k", "top_p"}), logits_mask=True)


class ClampsMaskedLogits(MaskedTopPSampler):
    """Declares ``logits_mask`` but turns ``-inf`` into 0 first (a "NaN-safe" cleanup): masked tokens come back."""

    name = "clamps-masked-logits"

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return super().sample(logits.nan_to_num(neginf=0.0), metadata)
