"""The ``paged`` KV-cache manager: fixed-size blocks, reference counts, prefix caching by chained hashes.

Bookkeeping only, pure Python: the K/V tensors belong to the attention backend, indexed by the block
ids this manager hands out (token ``j`` of a sequence lives in block ``block_table[j // block_size]``,
offset ``j % block_size``).

Prefix caching: the key of full block ``i`` of a sequence is ``hash_fn(key of block i-1, tokens of
block i)`` (``None`` stands in for the key before block 0), so a key names the whole prefix up to and
including that block.  A lookup that finds a key is accepted only when the stored block holds the
same tokens *and* was registered on top of the block matched just before it (each registration has a
unique serial number, and a block remembers its parent's), so a hash collision never serves KV
computed for other tokens.

A sequence may carry an extra key (:meth:`PagedKVCacheManager.set_extra_key`: its LoRA adapter) that
every one of its blocks' keys depends on: its first block's key is ``hash_fn(("extra", key), tokens)``
and its parent serial is a root of that key's own, so a block is reused only by sequences with the
same extra key (the same adapter, or none), never across them, even on a hash collision.

Free blocks are kept in two pools: blocks without content worth keeping (never used, or not full /
not registered), taken first, and cached blocks that still carry a registered key, kept in the
order they were freed and evicted least recently freed first.  Both pools count as free.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Hashable, Optional, Sequence

from corerun.errors import ConfigError
from corerun.protocols.kv_cache import KVCacheStats

HashFn = Callable[[Optional[Hashable], tuple[int, ...]], Hashable]
"""``hash_fn(parent_key, block_tokens) -> key``; ``parent_key`` is ``None`` for a sequence's first block."""

_ROOT_SERIAL = -1  # parent serial of a sequence's first block


def chained_hash(parent_key: Optional[Hashable], block_tokens: tuple[int, ...]) -> Hashable:
    """The default block key: ``hash((parent_key, block_tokens))``."""
    return hash((parent_key, block_tokens))


@dataclass(slots=True)
class _SeqState:
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading full blocks whose key is known (registered or found)
    last_key: Optional[Hashable] = None  # key of block num_hashed_blocks - 1
    last_serial: int = _ROOT_SERIAL  # serial of the registered entry holding that content
    # (tokens looked up, tokens found) by get_computed_prefix, counted in stats() only once an
    # allocate_slots for the sequence succeeds: an admission that fails and is retried counts once
    pending_lookup: Optional[tuple[int, int]] = None
    num_returned: int = 0  # table length when allocate_slots last returned (lowered by trim)


class PagedKVCacheManager:
    """Hands out blocks of ``block_size`` token slots out of ``num_blocks``; shares full prefix blocks.

    ``hash_fn`` replaces the block key function (see :data:`HashFn`); tests pass a constant one to
    force collisions.  With ``prefix_caching=False`` no key is computed and nothing is ever shared.
    """

    name: ClassVar[str] = "paged"

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        prefix_caching: bool = True,
        hash_fn: HashFn | None = None,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"kv_cache.num_blocks must be an integer >= 1, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"kv_cache.block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = bool(prefix_caching)
        self.hash_fn: HashFn = hash_fn if hash_fn is not None else chained_hash
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Forget every sequence and every cached prefix: all blocks free and empty, stats zeroed."""
        n = self.num_blocks
        self._ref_count = [0] * n
        self._key: list[Optional[Hashable]] = [None] * n  # registered key
        self._tokens: list[Optional[tuple[int, ...]]] = [None] * n  # registered tokens; None: not registered
        self._serial = [0] * n
        self._parent_serial = [0] * n
        self._cached: dict[Hashable, int] = {}  # key -> block holding that prefix
        self._free_empty: deque[int] = deque(range(n))  # no registered content: taken first
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # registered, ref 0; least recently freed first
        self._seqs: dict[int, _SeqState] = {}
        self._extra: dict[int, Hashable] = {}  # seq_id -> its extra key, until it is freed
        self._roots: dict[Hashable, int] = {}  # extra key -> the parent serial of its sequences' first blocks
        self._serials = itertools.count()
        self._prefix_queries = 0
        self._prefix_hits = 0

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (e.g. after the weights changed).

        Only possible while no sequence holds blocks (their KV would go stale silently otherwise):
        returns ``False`` and changes nothing if any block is in use, ``True`` once the cache is empty.
        """
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in list(self._free_cached):
            self._drop_key(block)
            self._free_empty.append(block)
        self._free_cached.clear()
        return True

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: empty ones plus cached ones that nobody references (evictable)."""
        return len(self._free_empty) + len(self._free_cached)

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            num_cached_blocks=len(self._cached),
            prefix_queries=self._prefix_queries,
            prefix_hits=self._prefix_hits,
        )

    def block_table(self, seq_id: int) -> list[int]:
        """Physical block ids of ``seq_id`` in order (a copy); raises ``ValueError`` for an unknown id."""
        state = self._seqs.get(seq_id)
        if state is None:
            raise ValueError(
                f"sequence {seq_id!r} has no blocks; call get_computed_prefix / allocate_slots for it first"
            )
        return list(state.block_table)

    def set_extra_key(self, seq_id: int, key: Hashable) -> None:
        """Key ``seq_id``'s blocks by ``key`` too (``None``: no extra key), before its first
        ``get_computed_prefix`` / ``allocate_slots``; kept until :meth:`free`."""
        state = self._seqs.get(seq_id)
        if state is not None and state.block_table:
            raise ValueError(f"sequence {seq_id!r} already holds blocks; set its extra key before it gets any")
        if key is None:
            self._extra.pop(seq_id, None)
        else:
            self._extra[seq_id] = key

    def _new_state(self, seq_id: int) -> _SeqState:
        key = self._extra.get(seq_id)
        if key is None:
            return _SeqState()
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = _ROOT_SERIAL - 1 - len(self._roots)  # (negative: never a block's serial)
        return _SeqState(last_key=("extra", key), last_serial=root)

    # ------------------------------------------------------------------ protocol

    def get_computed_prefix(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Claim cached blocks holding a prefix of ``token_ids``; return how many tokens they cover.

        Covers whole blocks only, and at most ``len(token_ids) - 1`` tokens (the last prompt token is
        always recomputed so its logits exist).  The found blocks get one more reference each and
        start ``seq_id``'s block table.  Raises ``ValueError`` if ``seq_id`` already holds blocks.
        """
        state = self._seqs.get(seq_id)
        if state is not None and state.block_table:
            raise ValueError(
                f"sequence {seq_id!r} already holds {len(state.block_table)} blocks; get_computed_prefix is for "
                "its first scheduling only (free it first to start over)"
            )
        state = self._new_state(seq_id)
        self._seqs[seq_id] = state
        if not self.prefix_caching:
            return 0
        bs = self.block_size
        max_blocks = max(len(token_ids) - 1, 0) // bs
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            key = self.hash_fn(state.last_key, tokens)
            block = self._cached.get(key)
            if block is None or self._tokens[block] != tokens or self._parent_serial[block] != state.last_serial:
                break
            if self._ref_count[block] == 0:
                del self._free_cached[block]  # revive an evictable block
            self._ref_count[block] += 1
            state.block_table.append(block)
            state.num_hashed_blocks, state.last_key, state.last_serial = i + 1, key, self._serial[block]
        num_hit_tokens = len(state.block_table) * bs
        state.pending_lookup = (len(token_ids), num_hit_tokens)
        return num_hit_tokens

    def allocate_slots(self, seq_id: int, num_tokens: int) -> list[int] | None:
        """Grow ``seq_id``'s table to ``ceil(num_tokens / block_size)`` blocks (never shrinks it) and
        return the ids it gained since the last successful call (first call: the whole table, the
        prefix ``get_computed_prefix`` claimed included; after ``trim``: from the kept length on).

        Returns ``None`` and changes nothing when too few blocks are free.  Empty blocks are taken
        first, then cached free blocks are evicted, least recently freed first.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens} (sequence {seq_id!r})")
        state = self._seqs.get(seq_id)
        have = len(state.block_table) if state is not None else 0
        need = -(-num_tokens // self.block_size) - have
        if need > self.num_free_blocks:
            return None
        if state is None:
            state = self._seqs[seq_id] = self._new_state(seq_id)
        for _ in range(need):
            state.block_table.append(self._take_free_block())
        if state.pending_lookup is not None:
            queried, hit = state.pending_lookup
            self._prefix_queries += queried
            self._prefix_hits += hit
            state.pending_lookup = None
        start, state.num_returned = state.num_returned, len(state.block_table)
        return state.block_table[start:]

    def cache_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the keys of ``seq_id``'s full blocks within its first ``num_computed_tokens`` tokens.

        ``token_ids`` are all of the sequence's tokens so far (prompt + output).  Blocks registered
        earlier are skipped; when another block already holds the same prefix, that entry is kept and
        this sequence's block stays unregistered (it is freed as empty).
        """
        state = self._seqs.get(seq_id)
        if state is None:
            raise ValueError(f"sequence {seq_id!r} has no blocks; allocate_slots must come before cache_blocks")
        capacity = len(state.block_table) * self.block_size
        if not 0 <= num_computed_tokens <= min(len(token_ids), capacity):
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} for sequence {seq_id!r} must be between 0 and "
                f"min(len(token_ids)={len(token_ids)}, allocated slots={capacity})"
            )
        if not self.prefix_caching:
            return
        bs = self.block_size
        for i in range(state.num_hashed_blocks, num_computed_tokens // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            key = self.hash_fn(state.last_key, tokens)
            block = state.block_table[i]
            holder = self._cached.get(key)
            if holder is None:
                serial = self._register(block, key, tokens, state.last_serial)
            elif holder == block or (
                self._tokens[holder] == tokens and self._parent_serial[holder] == state.last_serial
            ):
                serial = self._serial[holder]  # same prefix already registered: keep that entry
            else:
                serial = next(self._serials)  # collision with another prefix: keep it, match nothing
            state.num_hashed_blocks, state.last_key, state.last_serial = i + 1, key, serial

    def trim(self, seq_id: int, num_tokens: int) -> int:
        """Shrink ``seq_id``'s table to ``ceil(num_tokens / block_size)`` blocks, freeing the tail (the blocks
        speculative decoding took only for draft tokens that were rejected), and return its length after.
        Registered (hashed) blocks are never dropped; a no-op for a table already that short (0 for an
        unknown id)."""
        state = self._seqs.get(seq_id)
        if state is None:
            return 0
        keep = max(-(-num_tokens // self.block_size), state.num_hashed_blocks)
        while len(state.block_table) > keep:
            block = state.block_table.pop()
            self._ref_count[block] -= 1
            if self._ref_count[block] == 0:
                if self._tokens[block] is not None:  # registered (shared with another sequence's prefix)
                    self._free_cached[block] = None
                else:
                    self._free_empty.appendleft(block)  # taken again first (the next draft step wants one)
        state.num_returned = min(state.num_returned, len(state.block_table))
        return len(state.block_table)

    def free(self, seq_id: int) -> None:
        """Drop ``seq_id``'s references, tail block first; a no-op for an unknown id.

        A block nobody references any more becomes free: cached (evictable, keeps its key) when
        registered, empty otherwise.  Freeing the tail first makes it evicted before the prefix.
        """
        self._extra.pop(seq_id, None)
        state = self._seqs.pop(seq_id, None)
        if state is None:
            return
        for block in reversed(state.block_table):
            self._ref_count[block] -= 1
            if self._ref_count[block] == 0:
                if self._tokens[block] is not None:  # registered
                    self._free_cached[block] = None
                else:
                    self._free_empty.append(block)

    # ------------------------------------------------------------------ helpers

    def _take_free_block(self) -> int:
        if self._free_empty:
            block = self._free_empty.popleft()
        else:
            block, _ = self._free_cached.popitem(last=False)  # evict the least recently freed
            self._drop_key(block)
        self._ref_count[block] = 1
        return block

    def _register(self, block: int, key: Hashable, tokens: tuple[int, ...], parent_serial: int) -> int:
        serial = next(self._serials)
        self._cached[key] = block
        self._key[block], self._tokens[block] = key, tokens
        self._serial[block], self._parent_serial[block] = serial, parent_serial
        return serial

    def _drop_key(self, block: int) -> None:
        del self._cached[self._key[block]]
        self._key[block] = self._tokens[block] = None
