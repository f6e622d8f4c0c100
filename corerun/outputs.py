"""vLLM-shaped results: ``RequestOutput`` -> ``CompletionOutput`` -> per-token ``Logprob`` dicts."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# one dict per generated (or prompt) token: token id -> Logprob
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop token id (stop_token_ids) or stop string (stop) that ended it
    logprobs: SampleLogprobs | None = None
    error: str | None = None  # set when finish_reason == "error"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # arrival / first_token / finished times (s)


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # the pooled vector (empty until the request finishes)


@dataclass
class EmbeddingRequestOutput:
    """An embedding request's result (``LLM.embed``), shaped like vLLM's: ``outputs.embedding``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = False
    finish_reason: str | None = None  # "stop" once pooled; "abort" or "error" otherwise
    error: str | None = None
