"""What the KV-cache suite wraps around a manager: random token ids that never share a block by chance,
and a recorder that checks every id list ``allocate_slots`` returns (protocol version 3)."""

from __future__ import annotations

import random
from typing import Any, Sequence


class Tokens:
    """Random token ids from a huge vocabulary, so unrelated sequences never share a block by chance."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(10**6) for _ in range(n)]


class ReturnedIds:
    """Hands the scheduler a manager and checks every id list its ``allocate_slots`` returns against the
    manager's own ``block_table``: the entries from the table's length at the previous successful call
    on (0 after ``get_computed_prefix`` or ``free``; lowered to what a ``trim`` kept).  ``problem``: the
    first mismatch, for the check to report (the scheduler would wrap an exception raised here)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.returned: dict[int, int] = {}  # seq_id -> table length when allocate_slots last returned
        self.problem = ""

    def __getattr__(self, name: str) -> Any:
        if name == "trim":
            trim = getattr(self.inner, "trim")

            def trimmed(seq_id: int, num_tokens: int) -> Any:
                kept = trim(seq_id, num_tokens)
                self.returned[seq_id] = min(self.returned.get(seq_id, 0), len(self.inner.block_table(seq_id)))
                return kept
            return trimmed
        return getattr(self.inner, name)

    def get_computed_prefix(self, seq_id: int, token_ids: Sequence[int]) -> int:
        self.returned[seq_id] = 0
        return self.inner.get_computed_prefix(seq_id, token_ids)

    def free(self, seq_id: int) -> None:
        self.returned.pop(seq_id, None)
        self.inner.free(seq_id)

    def allocate_slots(self, seq_id: int, num_tokens: int) -> Any:
        ids = self.inner.allocate_slots(seq_id, num_tokens)
        if ids is None:
            return None
        table = self.inner.block_table(seq_id)
        start = self.returned.get(seq_id, 0)
        if list(ids) != table[start:] and not self.problem:
            self.problem = (f"allocate_slots({seq_id}, {num_tokens}) returned {list(ids)!r}; the table is {table}, last "
                            f"returned at length {start}, so it must return {table[start:]!r}")
        self.returned[seq_id] = len(table)
        return ids
