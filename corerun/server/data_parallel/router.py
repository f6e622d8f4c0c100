"""Which replica takes a request: the one with the fewest outstanding tokens, unless a replica already
holds the request's prompt prefix and is not much busier (prefix affinity).

A replica's outstanding tokens are what its requests still ask of it: a request's prompt until its
first output arrives, and ``n * max_tokens`` less what it has generated (the replica clients keep
the count; the router only reads it).  Prefix affinity works in whole KV blocks, as prefix caching
does: the router remembers, for the first ``max_blocks`` block-aligned prefixes of every prompt it
routed, the replica it sent it to, and a new prompt goes where its longest remembered prefix went,
as long as that replica's load is at most ``2 * least + slack_tokens`` (``least``: the load of the
least busy live replica).  A prompt shorter than one block has no prefix to share and goes to the
least busy replica; ties go to the lowest index.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence


class Router:
    """Chooses a replica for each prompt; remembers where prefixes went (at most ``max_prefixes`` of them,
    least recently used forgotten first)."""

    def __init__(self, block_size: int, *, slack_tokens: int = 2048, max_blocks: int = 32,
                 max_prefixes: int = 1 << 16) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.slack_tokens = slack_tokens
        self.max_blocks = max_blocks
        self.max_prefixes = max_prefixes
        self._where: OrderedDict[int, int] = OrderedDict()  # prefix hash -> replica index
        self._lock = threading.Lock()

    def choose(self, prompt: Sequence[int], loads: Sequence[int | None]) -> int:
        """The replica for ``prompt``, given each replica's outstanding tokens (``None``: not serving).
        Raises ``LookupError`` when no replica is serving."""
        live = [i for i, load in enumerate(loads) if load is not None]
        if not live:
            raise LookupError("no replica is serving")
        least = min(live, key=lambda i: (loads[i], i))
        keys = self._prefix_keys(prompt)
        with self._lock:
            chosen = least
            for key in reversed(keys):  # the longest remembered prefix first
                r = self._where.get(key)
                if r is None:
                    continue
                load = loads[r] if r < len(loads) else None
                if load is not None and load <= 2 * loads[least] + self.slack_tokens:  # type: ignore[operator]
                    chosen = r
                break
            for key in keys:
                self._where[key] = chosen
                self._where.move_to_end(key)
            while len(self._where) > self.max_prefixes:
                self._where.popitem(last=False)
        return chosen

    def _prefix_keys(self, prompt: Sequence[int]) -> list[int]:
        """One hash per whole block of the prompt's first ``max_blocks`` blocks, each chained to the one before."""
        b = self.block_size
        keys, h = [], 0
        for k in range(min(len(prompt) // b, self.max_blocks)):
            h = hash((h, tuple(prompt[k * b:(k + 1) * b])))
            keys.append(h)
        return keys
