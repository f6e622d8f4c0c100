"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

from corerun.lora.request import LoRARequest
from corerun.outputs import Logprob
from corerun.sampling_params import SamplingParams


class TokenView(SequenceABC):
    """``tokens[start:]`` as a read-only sequence, without a copy."""

    __slots__ = ("_tokens", "_start")

    def __init__(self, tokens: list[int], start: int) -> None:
        self._tokens = tokens
        self._start = start

    def __len__(self) -> int:
        return len(self._tokens) - self._start

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return self._tokens[self._start :][i]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("token index out of range")
        return self._tokens[self._start + i]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._tokens, self._start, None)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: tuple[int, ...]  # immutable: the scheduler's message to the runner carries this tuple itself
    params: SamplingParams
    prompt: str | None = None
    arrival_time: float = 0.0
    token_ids: list[int] = field(default_factory=list)  # prompt + output, appended in place
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    # speculative decoding: draft tokens proposed after the last step, verified when the request is next
    # scheduled as a decode (set by Scheduler.update_draft_token_ids, dropped on preemption and finish)
    draft_token_ids: list[int] = field(default_factory=list)
    # an embedding request (params.pooling): its pooled vector, set when its prompt is computed
    pooled: list[float] | None = None
    # the adapter the request runs under (corerun.lora); None: the base model
    lora: LoRARequest | None = None

    def __post_init__(self) -> None:
        if type(self.prompt_token_ids) is not tuple:  # (a list given: copied once, here, on arrival)
            self.prompt_token_ids = tuple(self.prompt_token_ids)
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob (a one-token prompt: that is all)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the generated tokens."""
        return self.token_ids[self.num_prompt_tokens :]

    def output_view(self) -> "TokenView":
        """The generated tokens without copying them (for the per-step sampling metadata)."""
        return TokenView(self.token_ids, self.num_prompt_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    def tokens_left(self, max_model_len: int) -> int:
        """Tokens this request may still get before ``max_tokens`` or ``max_model_len`` ends it."""
        return min(self.params.max_tokens - self.num_output_tokens, max_model_len - self.num_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs still owed (entries are kept across preemptions, so recompute skips them)."""
        return self.params.prompt_logprobs is not None and (
            self.prompt_logprobs is None or len(self.prompt_logprobs) < self.num_prompt_tokens
        )


def verified_tokens(seq: Sequence, n: int, drafts: tuple[int, ...], emitted: list[int]) -> tuple[int, list[int]]:
    """A decode with ``drafts`` that emitted ``emitted``: the tokens it computed (``n`` less the rejected
    drafts) and the tokens whose K/V the cache now holds.  K/V of rejected drafts stay in their slots,
    overwritten when those positions are computed."""
    accepted = len(emitted) - 1
    n -= len(drafts) - max(accepted, 0)
    return n, (seq.token_ids + emitted[:accepted] if accepted > 0 else seq.token_ids)


def pools_every_token(seq: Sequence) -> bool:
    """An embedding request that reads hidden states other than its last token's (mean, cls)."""
    pooling = seq.params.pooling
    return pooling is not None and pooling.pooling_type != "last"
