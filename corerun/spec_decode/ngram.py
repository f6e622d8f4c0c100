"""N-gram (prompt lookup) draft proposals over a request's prompt + output tokens."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from corerun.spec_decode.proposer import Proposer


class NgramProposer(Proposer):
    """Drafts the tokens that followed the latest earlier occurrence of the request's last ``n`` tokens.

    ``n`` goes from ``prompt_lookup_max`` down to ``prompt_lookup_min``; the first ``n`` that matches
    wins, and at most ``num_tokens`` tokens are proposed (fewer when the match is near the end).
    """

    def __init__(self, num_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min} and {prompt_lookup_max}"
            )
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self.num_tokens = num_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, wanted: Sequence[tuple[int, Sequence[int], int]]) -> dict[int, list[int]]:  # type: ignore[override]
        return {seq_id: self.lookup(tokens, k) for seq_id, tokens, k in wanted}

    def lookup(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """Draft tokens to follow ``token_ids`` (at most ``min(num_tokens, max_tokens)``); ``[]`` when none match."""
        k = self.num_tokens if max_tokens is None else min(self.num_tokens, max_tokens)
        size = len(token_ids)
        if k < 1 or size <= self.min_n:
            return []
        a = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # windows start at s with s + n <= size - 1: at least one token follows every match
            windows = sliding_window_view(a[: size - 1], n)
            hits = np.flatnonzero((windows == a[size - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return a[start : start + k].tolist()
        return []
