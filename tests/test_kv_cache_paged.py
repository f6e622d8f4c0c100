"""The ``paged`` KV-cache manager: allocation, exhaustion, prefix hits, eviction order, collisions, sharing.

Expected block counts and hit lengths are worked out by hand in each test; the random workload checks
the manager against a separate simulation of the cache contents (which tokens each block holds).
"""

from __future__ import annotations

import random

import pytest

from corerun.kv_cache.paged import PagedKVCacheManager
from corerun.protocols.kv_cache import KVCacheManager


def prefill(m: PagedKVCacheManager, seq_id: int, tokens: list[int]) -> int:
    """What the engine does for a new sequence: look up, allocate the prompt, compute it, register blocks."""
    hit = m.get_computed_prefix(seq_id, tokens)
    assert m.allocate_slots(seq_id, len(tokens)) is not None
    m.cache_blocks(seq_id, tokens, len(tokens))
    return hit


def used_blocks(m: PagedKVCacheManager, seq_ids: list[int]) -> set[int]:
    return {b for s in seq_ids for b in m.block_table(s)}


def test_registered_and_satisfies_the_protocol() -> None:
    from corerun.plugin.registry import get_registry

    m = get_registry().create("kv_cache", "paged", 8, 16, prefix_caching=True)
    assert isinstance(m, PagedKVCacheManager) and isinstance(m, KVCacheManager)
    assert m.name == "paged" and (m.num_blocks, m.block_size, m.num_free_blocks) == (8, 16, 8)


def test_allocate_slots_returns_what_the_table_gained() -> None:
    m = PagedKVCacheManager(num_blocks=10, block_size=4)
    a = list(range(100, 113))  # 13 tokens: 4 blocks, the first 3 full
    got = m.allocate_slots(1, len(a))
    assert got is not None and len(got) == 4 and len(set(got)) == 4
    m.cache_blocks(1, a, len(a))
    assert m.allocate_slots(1, 16) == [] and m.allocate_slots(1, 17) is not None  # room in block 4: nothing new; then 1
    b = a[:8] + [7, 8, 9]  # shares a's first two blocks
    assert m.get_computed_prefix(2, b) == 8
    got = m.allocate_slots(2, len(b))  # the claimed prefix blocks first, then the one taken
    assert got is not None and got[:2] == m.block_table(1)[:2] and len(got) == 3 and got[2] not in m.block_table(1)
    nxt = m.allocate_slots(2, 13)  # grows by one block: only that one
    assert nxt is not None and len(nxt) == 1 and nxt[0] not in got
    free = m.num_free_blocks
    assert m.allocate_slots(3, 4 * (free + 1)) is None and m.num_free_blocks == free
    m.free(2)
    assert m.get_computed_prefix(2, b) == 8 and m.allocate_slots(2, len(b))[:2] == got[:2]  # after free: whole again


def test_allocate_slots_rounds_up_to_whole_blocks() -> None:
    m = PagedKVCacheManager(10, 4)
    assert m.allocate_slots(1, 1) is not None and len(m.block_table(1)) == 1
    assert m.allocate_slots(1, 4) is not None and len(m.block_table(1)) == 1
    assert m.allocate_slots(1, 5) is not None and len(m.block_table(1)) == 2
    assert m.allocate_slots(1, 3) is not None and len(m.block_table(1)) == 2  # never shrinks
    assert m.allocate_slots(2, 0) is not None and m.block_table(2) == []
    assert m.num_free_blocks == 8
    assert len(set(m.block_table(1))) == 2


def test_prompt_of_exactly_one_block_gets_no_hit() -> None:
    m = PagedKVCacheManager(8, 4)
    prefill(m, 1, [1, 2, 3, 4])
    assert m.stats().num_cached_blocks == 1
    # 4 tokens: at most 3 may come from the cache, which is less than one block -> 0.
    assert m.get_computed_prefix(2, [1, 2, 3, 4]) == 0
    assert m.block_table(2) == []
    # block + 1 tokens: one whole block (4 tokens) is reused, the 5th is computed.
    assert m.get_computed_prefix(3, [1, 2, 3, 4, 5]) == 4
    assert m.block_table(3) == m.block_table(1)[:1]
    # two cached blocks, 8-token prompt: 7 tokens allowed -> still only one block.
    prefill(m, 4, [1, 2, 3, 4, 5, 6, 7, 8])
    assert m.get_computed_prefix(5, [1, 2, 3, 4, 5, 6, 7, 8]) == 4
    assert m.get_computed_prefix(6, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8


def test_exhaustion_returns_false_and_changes_nothing() -> None:
    m = PagedKVCacheManager(3, 4)
    assert m.allocate_slots(1, 9) is not None  # 3 blocks
    table = m.block_table(1)
    assert m.num_free_blocks == 0
    assert m.allocate_slots(2, 1) is None
    assert m.allocate_slots(1, 13) is None
    assert m.block_table(1) == table and m.num_free_blocks == 0
    with pytest.raises(ValueError, match="2"):
        m.block_table(2)  # the failed call did not create sequence 2

    m = PagedKVCacheManager(4, 4)
    assert m.allocate_slots(1, 8) is not None  # 2 blocks, 2 left
    assert m.allocate_slots(2, 12) is None  # needs 3
    assert m.num_free_blocks == 2
    assert m.allocate_slots(2, 4) is not None  # 1 block
    assert m.allocate_slots(2, 12) is None  # needs 2 more, 1 left
    assert len(m.block_table(2)) == 1 and m.num_free_blocks == 1
    assert m.allocate_slots(2, 8) is not None and m.num_free_blocks == 0


def test_freed_hashed_blocks_are_reused_by_a_later_prompt() -> None:
    m = PagedKVCacheManager(6, 4)
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 18]  # 2 full blocks + 1 token
    assert prefill(m, 1, prompt) == 0
    first = m.block_table(1)
    m.free(1)
    st = m.stats()
    assert (st.num_free_blocks, st.num_cached_blocks) == (6, 2)  # cached blocks count as free
    # same 8-token prefix, different tail: both full blocks are found after sequence 1 is gone
    assert m.get_computed_prefix(2, prompt[:8] + [99, 98]) == 8
    assert m.block_table(2) == first[:2]
    assert m.num_free_blocks == 4  # the two revived blocks left the free pool
    assert m.allocate_slots(2, 10) is not None and m.block_table(2)[:2] == first[:2]
    st = m.stats()
    assert (st.prefix_queries, st.prefix_hits) == (9 + 10, 8)


def test_a_diverging_block_stops_the_match() -> None:
    m = PagedKVCacheManager(8, 2)
    prefill(m, 1, [1, 2, 3, 4, 5, 6, 7])
    assert m.get_computed_prefix(2, [1, 2, 3, 9, 5, 6, 7]) == 2  # block 1 differs, block 2 not looked at
    assert m.get_computed_prefix(3, [9, 2, 3, 4, 5, 6, 7]) == 0
    assert m.get_computed_prefix(4, [1, 2, 3, 4, 5, 6, 0]) == 6


def test_empty_blocks_are_taken_before_cached_ones() -> None:
    m = PagedKVCacheManager(3, 2)
    prefill(m, 1, [1, 2])
    m.free(1)
    assert m.allocate_slots(2, 4) is not None  # the two never-used blocks
    assert m.get_computed_prefix(3, [1, 2, 3]) == 2  # the cached block survived


def test_eviction_takes_the_least_recently_freed_block_first() -> None:
    m = PagedKVCacheManager(4, 2)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    prefill(m, 1, a)
    prefill(m, 2, b)
    a0, a1 = m.block_table(1)
    b0, b1 = m.block_table(2)
    m.free(2)  # frees b1, then b0
    m.free(1)  # then a1, a0: free order b1, b0, a1, a0
    assert m.num_free_blocks == 4 and m.stats().num_cached_blocks == 4
    assert m.allocate_slots(10, 2) is not None and m.block_table(10) == [b1]
    assert m.stats().num_cached_blocks == 3
    assert m.get_computed_prefix(11, b + [0]) == 2  # b0 still there, b1 gone
    m.free(11)  # b0 freed again: now the most recently freed
    assert m.allocate_slots(12, 4) is not None and m.block_table(12) == [a1, a0]
    assert m.get_computed_prefix(13, a + [0]) == 0
    assert m.get_computed_prefix(14, b + [0]) == 2 and m.block_table(14) == [b0]


def test_constant_hash_never_serves_other_tokens() -> None:
    m = PagedKVCacheManager(16, 2, hash_fn=lambda parent, tokens: 0)
    prefill(m, 1, [1, 2, 3, 4, 5])
    assert m.stats().num_cached_blocks == 1  # block 1 collides with block 0's entry: the entry is kept
    assert m.get_computed_prefix(2, [7, 8, 3, 4, 5]) == 0  # same key, other tokens
    # block 1 holds (1, 2) like the cached block, but after a different prefix: only block 0 may match
    assert m.get_computed_prefix(3, [1, 2, 1, 2, 9]) == 2
    assert m.block_table(3) == m.block_table(1)[:1]


def test_a_hash_that_ignores_the_prefix_is_caught_by_the_parent_check() -> None:
    m = PagedKVCacheManager(16, 2, hash_fn=lambda parent, tokens: hash(tokens))
    prefill(m, 1, [5, 6, 3, 4])  # registers (5,6) and (3,4) after (5,6)
    prefill(m, 2, [1, 2, 3, 4])  # registers (1,2); (3,4) after (1,2) collides with sequence 1's block
    # (3, 4) is cached, but its KV was computed after (5, 6): reusing it for [1, 2, 3, 4] would be wrong
    assert m.get_computed_prefix(3, [1, 2, 3, 4, 0]) == 2
    assert m.block_table(3) == m.block_table(2)[:1]
    assert m.get_computed_prefix(4, [5, 6, 3, 4, 0]) == 4


def test_shared_blocks_stay_allocated_until_the_last_reference_drops() -> None:
    m = PagedKVCacheManager(8, 4)
    prompt = list(range(100, 109))  # 9 tokens: 3 blocks, 2 full
    prefill(m, 1, prompt)
    assert m.get_computed_prefix(2, prompt) == 8
    assert m.allocate_slots(2, 9) is not None
    shared = m.block_table(1)[:2]
    assert m.block_table(2)[:2] == shared and m.block_table(2)[2] != m.block_table(1)[2]
    assert m.num_free_blocks == 8 - 4
    m.free(1)  # only sequence 1's own tail block is freed
    assert m.num_free_blocks == 5 and m.block_table(2)[:2] == shared
    assert m.allocate_slots(3, 20) is not None  # all five free blocks: none of sequence 2's
    assert not set(m.block_table(3)) & set(m.block_table(2))
    assert m.allocate_slots(4, 1) is None
    m.free(3)
    m.free(2)
    assert m.num_free_blocks == 8
    assert m.get_computed_prefix(5, prompt) == 8 and m.block_table(5) == shared


def test_output_blocks_are_cached_too() -> None:
    m = PagedKVCacheManager(8, 2)
    tokens = [1, 2, 3]
    prefill(m, 1, tokens)
    for t in (4, 5, 6):  # decode: the new token's KV is written in the next step
        tokens.append(t)
        assert m.allocate_slots(1, len(tokens)) is not None
        m.cache_blocks(1, tokens, len(tokens) - 1)
    # computed: 5 tokens -> blocks (1,2), (3,4) registered; (5,6) not yet computed
    assert m.stats().num_cached_blocks == 2
    assert m.get_computed_prefix(2, [1, 2, 3, 4, 5, 6, 7]) == 4


def test_prefix_caching_off_never_shares() -> None:
    m = PagedKVCacheManager(8, 2, prefix_caching=False)
    prompt = [1, 2, 3, 4, 5]
    assert prefill(m, 1, prompt) == 0
    m.free(1)
    assert prefill(m, 2, prompt) == 0
    assert prefill(m, 3, prompt) == 0
    assert not set(m.block_table(2)) & set(m.block_table(3))
    st = m.stats()
    assert (st.num_cached_blocks, st.prefix_queries, st.prefix_hits, st.num_free_blocks) == (0, 0, 0, 2)


def test_misuse_raises_errors_that_name_the_sequence() -> None:
    m = PagedKVCacheManager(8, 2)
    prefill(m, 7, [1, 2, 3])
    with pytest.raises(ValueError, match="sequence 7 already holds 2 blocks"):
        m.get_computed_prefix(7, [1, 2, 3])
    with pytest.raises(ValueError, match="num_computed_tokens=5 for sequence 7"):
        m.cache_blocks(7, [1, 2, 3, 4, 5], 5)  # only 4 slots allocated
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        m.allocate_slots(7, -1)
    with pytest.raises(ValueError, match="sequence 8 has no blocks"):
        m.cache_blocks(8, [1, 2], 2)
    m.free(12345)  # unknown: no-op
    assert m.num_free_blocks == 6
    with pytest.raises(ValueError, match="num_blocks must be an integer >= 1, got 0"):
        PagedKVCacheManager(0, 16)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 0"):
        PagedKVCacheManager(4, 0)


def test_reset_prefix_cache_only_when_idle_and_reset() -> None:
    m = PagedKVCacheManager(4, 2)
    prefill(m, 1, [1, 2, 3])
    assert m.reset_prefix_cache() is False
    assert m.stats().num_cached_blocks == 1
    m.free(1)
    assert m.reset_prefix_cache() is True
    assert m.stats().num_cached_blocks == 0 and m.num_free_blocks == 4
    assert m.get_computed_prefix(2, [1, 2, 3]) == 0
    prefill(m, 3, [1, 2, 3])
    m.reset()
    st = m.stats()
    assert (st.num_free_blocks, st.num_cached_blocks, st.prefix_queries, st.prefix_hits) == (4, 0, 0, 0)


@pytest.mark.parametrize(
    "hash_fn",
    [None, lambda parent, tokens: hash((parent, tokens)) % 3],
    ids=["default-hash", "three-bucket-hash"],
)
def test_random_workload_serves_right_tokens_and_never_leaks(hash_fn) -> None:
    """Engine-like random workload against a simulation of the cache memory.

    ``memory[block][offset]`` is the token whose KV was last written there.  A prefix hit must point
    at blocks whose memory holds exactly the prompt's tokens; writes may only go to blocks that no
    other live sequence references; after freeing everything every block is free again.
    """
    rng = random.Random(1234)
    num_blocks, bs = 24, 4
    m = PagedKVCacheManager(num_blocks, bs, hash_fn=hash_fn)
    memory: dict[int, list[int | None]] = {b: [None] * bs for b in range(num_blocks)}
    prefixes = [[rng.randrange(6) for _ in range(rng.randrange(0, 13))] for _ in range(4)]
    live: dict[int, list[int]] = {}  # seq id -> tokens
    computed: dict[int, int] = {}
    total_hits, next_id = 0, 0

    def write(seq: int, start: int, end: int) -> None:
        table = m.block_table(seq)
        others = {b for s in live if s != seq for b in m.block_table(s)}
        for j in range(start, end):
            block = table[j // bs]
            assert block not in others, f"write into block {block} shared with another sequence"
            memory[block][j % bs] = live[seq][j]

    def check_accounting() -> None:
        used = {b for s in live for b in m.block_table(s)}
        for s in live:
            assert len(set(m.block_table(s))) == len(m.block_table(s))
        assert m.num_free_blocks == num_blocks - len(used)

    for _ in range(600):
        op = rng.random()
        if op < 0.35 or not live:
            seq, next_id = next_id, next_id + 1
            tokens = list(rng.choice(prefixes)) + [rng.randrange(6) for _ in range(rng.randrange(1, 6))]
            live[seq] = tokens
            hit = m.get_computed_prefix(seq, tokens)
            assert hit % bs == 0 and hit <= len(tokens) - 1
            table = m.block_table(seq)
            assert len(table) == hit // bs
            for j in range(hit):
                assert memory[table[j // bs]][j % bs] == tokens[j], "prefix hit serves other tokens"
            if m.allocate_slots(seq, len(tokens)) is None:
                m.free(seq)  # refused admission: its lookup is not counted
                del live[seq]
                check_accounting()
                continue
            total_hits += hit
            write(seq, hit, len(tokens))
            computed[seq] = len(tokens)
            m.cache_blocks(seq, tokens, computed[seq])
        elif op < 0.75:
            seq = rng.choice(list(live))
            live[seq].append(rng.randrange(6))
            if m.allocate_slots(seq, len(live[seq])) is None:
                m.free(seq)
                del live[seq]
                check_accounting()
                continue
            write(seq, computed[seq], len(live[seq]))
            computed[seq] = len(live[seq])
            m.cache_blocks(seq, live[seq], computed[seq])
        else:
            seq = rng.choice(list(live))
            m.free(seq)
            del live[seq]
        check_accounting()

    assert total_hits > 0 and m.stats().prefix_hits == total_hits
    for seq in list(live):
        m.free(seq)
    assert m.num_free_blocks == num_blocks
    assert m.reset_prefix_cache() and m.stats().num_cached_blocks == 0


def test_prefix_stats_count_each_admission_once() -> None:
    """A lookup whose admission fails (freed before any allocation) is not counted; the retry is, once."""
    bs = 4
    m = PagedKVCacheManager(6, bs, prefix_caching=True)
    shared = list(range(100, 100 + 2 * bs))
    prefill(m, 1, shared + [1, 2, 3])  # 3 blocks, 2 of them full and registered
    assert (m.stats().prefix_queries, m.stats().prefix_hits) == (11, 0)
    m.free(1)  # the 2 registered blocks stay cached (evictable)
    assert m.allocate_slots(9, 4 * bs) is not None  # a hog takes 4 of the 6 blocks: the 2 cached ones survive
    prompt = shared + list(range(500, 500 + 3 * bs))  # 2 cached blocks + 3 new ones: 1 too many
    for _ in range(3):  # the scheduler's failed admission, retried on later steps
        assert m.get_computed_prefix(2, prompt) == 2 * bs
        assert m.allocate_slots(2, len(prompt)) is None
        m.free(2)
    assert (m.stats().prefix_queries, m.stats().prefix_hits) == (11, 0)
    m.free(9)
    assert m.get_computed_prefix(2, prompt) == 2 * bs
    assert m.allocate_slots(2, len(prompt)) is not None
    assert (m.stats().prefix_queries, m.stats().prefix_hits) == (11 + len(prompt), 2 * bs)
    assert m.allocate_slots(2, len(prompt) + 1) is not None  # later growth adds nothing to the lookup counts
    assert (m.stats().prefix_queries, m.stats().prefix_hits) == (11 + len(prompt), 2 * bs)
