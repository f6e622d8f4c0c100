"""Broken KV-cache managers: the built-in ``paged`` manager with one protocol-level bug wrapped around it."""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

from corerun.plugin.registry import get_registry


class _Wrapped:
    """Delegates every protocol call to a real ``paged`` manager."""

    name: ClassVar[str] = "wrapped-paged"

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        self.inner = get_registry().get("kv_cache", "paged").create(num_blocks, block_size, prefix_caching=prefix_caching)
        self.num_blocks, self.block_size = num_blocks, block_size

    @property
    def num_free_blocks(self) -> int:
        return self.inner.num_free_blocks

    def get_computed_prefix(self, seq_id: int, token_ids: Sequence[int]) -> int:
        return self.inner.get_computed_prefix(seq_id, token_ids)

    def allocate_slots(self, seq_id: int, num_tokens: int) -> list[int] | None:
        return self.inner.allocate_slots(seq_id, num_tokens)

    def cache_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        self.inner.cache_blocks(seq_id, token_ids, num_computed_tokens)

    def block_table(self, seq_id: int) -> list[int]:
        return self.inner.block_table(seq_id)

    def free(self, seq_id: int) -> None:
        self.inner.free(seq_id)

    def stats(self) -> Any:
        return self.inner.stats()


class LeaksOnFree(_Wrapped):
    """Broken: ``free`` forgets sequences holding more than two blocks (their blocks never come back)."""

    name = "leaks-on-free"

    def free(self, seq_id: int) -> None:
        if len(self.inner.block_table(seq_id)) <= 2:
            self.inner.free(seq_id)


class HitsWholePrompt(_Wrapped):
    """Broken: reports a fully cached, block-aligned prompt as entirely cached (nothing left to compute)."""

    name = "hits-whole-prompt"

    def get_computed_prefix(self, seq_id: int, token_ids: Sequence[int]) -> int:
        hit = self.inner.get_computed_prefix(seq_id, token_ids)
        if hit and len(token_ids) % self.block_size == 0 and hit == len(token_ids) - self.block_size:
            return len(token_ids)
        return hit


class InsertsBeforeTail(_Wrapped):
    """Broken: a table that grows to an even number of blocks (4 or more) gets its new block before the
    previous last one, so an entry already handed out changes while the sequence holds it."""

    name = "inserts-before-tail"

    def block_table(self, seq_id: int) -> list[int]:
        table = self.inner.block_table(seq_id)
        if len(table) >= 4 and len(table) % 2 == 0:
            table[-2], table[-1] = table[-1], table[-2]
        return table


class ReportsBlocksFromZero(_Wrapped):
    """Broken (protocol version 3): ``allocate_slots`` returns the whole table every time, so the blocks a
    sequence already had are stated again as appended (its row would repeat them)."""

    name = "reports-blocks-from-zero"

    def allocate_slots(self, seq_id: int, num_tokens: int) -> list[int] | None:
        if self.inner.allocate_slots(seq_id, num_tokens) is None:
            return None
        return self.inner.block_table(seq_id)


class OmitsClaimedPrefix(_Wrapped):
    """Broken (protocol version 3): ``allocate_slots`` returns only the blocks that call took, leaving out
    the prefix blocks ``get_computed_prefix`` claimed before a sequence's first allocation (a row with a
    prefix hit would start at the wrong block)."""

    name = "omits-claimed-prefix"

    def allocate_slots(self, seq_id: int, num_tokens: int) -> list[int] | None:
        try:
            before = len(self.inner.block_table(seq_id))
        except ValueError:  # (no blocks yet)
            before = 0
        ids = self.inner.allocate_slots(seq_id, num_tokens)
        return None if ids is None else self.inner.block_table(seq_id)[before:]
