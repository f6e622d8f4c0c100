"""The ``KVCacheManager`` protocol: which physical blocks hold which sequence's tokens.

The manager does bookkeeping only (block ids, reference counts, prefix hashes); the tensors
themselves belong to the attention backend.  A sequence goes through:

1. ``get_computed_prefix(seq_id, token_ids)`` on its first scheduling: claims cached blocks holding a
   block-aligned prefix of ``token_ids`` (never the whole prompt: the last prompt token is always
   recomputed so its logits exist) and returns how many tokens they cover.
2. ``allocate_slots(seq_id, num_tokens) -> list[int] | None`` before each step: grows the block
   table to hold ``num_tokens`` tokens and returns the block ids the table gained since the last
   successful ``allocate_slots`` for the sequence: on its first one (after ``get_computed_prefix``,
   or after a ``free``) the whole table, the claimed prefix blocks first; after a ``trim`` every
   entry from the kept length on.  Always ``block_table(seq_id)[start:]`` for that ``start``; an
   empty list when nothing was added (success: check ``is None``, not falsiness).  Returns ``None``
   and changes nothing when free blocks run out (exhaustion is reported, never raised); the
   scheduler then preempts.  The scheduler hands the ids to the runner in the step's
   ``ScheduledBatch`` (protocol version 3: nobody asks the manager again what it got).
3. ``cache_blocks(seq_id, token_ids, num_computed)`` after a step: registers the hashes of blocks
   that became full so later sequences can share them.
4. ``free(seq_id)`` when finished, aborted or preempted: drops references; freed blocks that hold
   cached content stay reusable until evicted (least recently freed first).

Optional: ``trim(seq_id, num_tokens) -> int`` shrinks a table at the end (speculative decoding gives
back the blocks it took only for rejected drafts) and returns the table's length after; the
scheduler reports the shrink to the runner like any other change, and the next ``allocate_slots``
returns the table's entries from that length on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, Sequence, runtime_checkable


@dataclass
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int  # allocatable now (includes evictable cached blocks)
    num_cached_blocks: int  # blocks with a registered prefix hash
    # prefix lookups count once per admission: get_computed_prefix's tokens are added when the
    # sequence's next allocate_slots succeeds (a lookup freed before that, e.g. a failed admission
    # the scheduler retries next step, is not counted)
    prefix_queries: int  # tokens looked up by get_computed_prefix
    prefix_hits: int  # tokens found


@runtime_checkable
class KVCacheManager(Protocol):
    """Factory signature: ``factory(num_blocks: int, block_size: int, *, prefix_caching: bool = True, **options)``."""

    name: ClassVar[str]
    block_size: int
    num_blocks: int

    @property
    def num_free_blocks(self) -> int: ...

    def get_computed_prefix(self, seq_id: int, token_ids: Sequence[int]) -> int: ...

    def allocate_slots(self, seq_id: int, num_tokens: int) -> list[int] | None:
        """The block ids ``seq_id``'s table gained since its last successful call (see the module
        docstring: prefix blocks and ``trim`` included), ``[]`` when none; ``None`` on exhaustion."""
        ...

    def cache_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None: ...

    def block_table(self, seq_id: int) -> list[int]:
        """Physical block ids of ``seq_id``'s tokens in order (token ``j`` lives in block ``[j // block_size]``).

        Contract the scheduler and runner rely on (the runner keeps each table across steps and
        applies the changes the scheduler reports): while a sequence holds blocks, its table only
        grows at the end, in ``get_computed_prefix`` and ``allocate_slots``; it changes otherwise only
        after ``free(seq_id)``, or shrinks at the end by the optional ``trim``.  Entries handed out
        are never rewritten while the sequence holds them; after ``free`` and a new admission under
        the same ``seq_id`` (a preemption) the table is a new one, reported whole.
        """
        ...

    def free(self, seq_id: int) -> None: ...

    def stats(self) -> KVCacheStats: ...
