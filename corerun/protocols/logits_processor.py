"""The ``LogitsProcessor`` protocol: per-request state that edits the logits of its rows before the sampler.

The runner (:mod:`corerun.runner.logits_processing`) drives it.  Keys are the engine's ``seq_id``: one per
sample (``n > 1`` gives each sample its own key and state), never reused, kept across preemption.

    prepare(params)                 admission, before the request is queued (may compile; raise to refuse it)
    add_request(key, params, out)   the first step that samples the request (``out``: tokens already made)
    apply(logits, rows, keys)       every step, in place, on ``logits[rows[i]]`` for ``keys[i]`` only
    accept(keys, tokens)            after sampling: advance each state by its token
    remove_request(key)             the request finished or was aborted
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, Sequence, runtime_checkable

import torch

from corerun.plugin.capabilities import LogitsProcessorCapabilities
from corerun.sampling_params import SamplingParams

# What ``accept`` returns per key: go on, or end the request with finish_reason "stop".
CONTINUE, STOP = None, "stop"


@runtime_checkable
class LogitsProcessor(Protocol):
    """Factory: ``factory(vocab_size, device, *, tokenizer, eos_token_ids, **options) -> LogitsProcessor``
    (``tokenizer``: the engine's Hugging Face tokenizer or ``None``; ``eos_token_ids``: frozenset)."""

    name: ClassVar[str]
    capabilities: ClassVar[LogitsProcessorCapabilities]

    def prepare(self, params: SamplingParams) -> None:
        """Validate (and compile) what ``params`` asks; raise ``ValueError`` with the reason to refuse the
        request alone.  Called at admission, possibly from another thread than the steps."""
        ...

    def add_request(self, key: int, params: SamplingParams, output_token_ids: Sequence[int]) -> None:
        """Create the state of ``key``, advanced over ``output_token_ids`` (empty for a new request)."""
        ...

    def apply(self, logits: torch.Tensor, rows: Sequence[int], keys: Sequence[int]) -> None:
        """Edit ``logits`` ``[B, V]`` in place: row ``rows[i]`` for ``keys[i]``; every other row stays as it is.
        No host sync unless ``capabilities.host_sync``."""
        ...

    def accept(self, keys: Sequence[int], tokens: Sequence[int]) -> list[str | None]:
        """Advance each key's state by its sampled token.  Per key: ``None`` to go on, ``"stop"`` when the
        request is complete (its grammar ended), any other string: why the token cannot be taken (the
        request ends with an error naming it)."""
        ...

    def remove_request(self, key: int) -> None:
        """Forget ``key`` (finished or aborted).  Unknown keys are ignored."""
        ...


def describe(processor: Any) -> str:
    return f"logits processor '{getattr(processor, 'name', type(processor).__name__)}'"
