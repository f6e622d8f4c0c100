"""The processors that can change the greedy choice and come before the penalties: logit bias, min_tokens."""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from corerun.sampler.common import to_device


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[Mapping[int, float] | None]) -> None:
    """Add ``biases[i][token]`` to ``logits[i, token]`` in place (float32 ``[B, V]``, contiguous); -inf bans the token."""
    vocab_size = logits.shape[1]
    index: list[int] = []
    values: list[float] = []
    for row, bias in enumerate(biases):
        if bias:
            index.extend(row * vocab_size + token for token in bias)
            values.extend(bias.values())
    if index:
        logits.view(-1).index_add_(
            0, to_device(index, torch.int64, logits.device), to_device(values, logits.dtype, logits.device)
        )


def apply_min_tokens(
    logits: torch.Tensor,
    min_tokens: Sequence[int],
    num_output_tokens: Sequence[int],
    stop_token_ids: Sequence[Iterable[int]],
) -> None:
    """Set ``logits[i, t] = -inf`` in place for each stop token ``t`` of row ``i`` while ``num_output_tokens[i] < min_tokens[i]``.

    ``stop_token_ids[i]``: the request's stop tokens and the model's EOS ids (ids outside the vocabulary are skipped).
    """
    vocab_size = logits.shape[1]
    index: list[int] = []
    for row, (low, done, stops) in enumerate(zip(min_tokens, num_output_tokens, stop_token_ids)):
        if done < low:
            index.extend(row * vocab_size + t for t in set(stops) if 0 <= t < vocab_size)
    if index:
        logits.view(-1).index_fill_(0, to_device(index, torch.int64, logits.device), float("-inf"))
