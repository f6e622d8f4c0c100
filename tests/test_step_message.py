"""The step message as the scheduler builds it (``make_batch``): the same value as the dataclass's own
constructor gives, decodes first, frozen, and whole after pickling (tensor-parallel rank 0 sends it)."""

from __future__ import annotations

import dataclasses
import pickle
import random
from types import MappingProxyType

import pytest

from corerun.core.batch import BlockIds, NewRequest, NewTokens, ScheduledBatch, make_batch
from corerun.sampling_params import SamplingParams


def test_make_batch_gives_what_the_constructor_gives_decodes_first() -> None:
    new = NewRequest(9, (1, 2, 3), (), SamplingParams(), (4,), 0)
    rows = {9: (None, 3, 0), 5: (None, 1, 40), 7: (None, 2, 11), 6: (None, 1, 17)}  # a prefill, a decode, a chunk, a decode
    tokens, changes, drafts = {5: NewTokens(40, (8,), 41)}, {6: BlockIds(4, (12,))}, {5: (3, 3)}
    batch = make_batch(rows, (new,), tokens, changes, drafts, frozenset({1}), frozenset({2}))
    expected = ScheduledBatch(
        (5, 6, 9, 7), (1, 1, 3, 2), 2, (new,), (40, 17, 0, 11), MappingProxyType(tokens), MappingProxyType(changes),
        MappingProxyType(drafts), frozenset({1}), frozenset({2}),
    )
    assert batch == expected and batch.num_tokens == 7 and batch.new_block_ids == {9: BlockIds(0, (4,)), 6: BlockIds(4, (12,))}
    assert pickle.loads(pickle.dumps(batch)) == expected
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.num_decodes = 0  # type: ignore[misc]
    assert dataclasses.replace(batch, num_decodes=1).num_decodes == 1 and batch.num_decodes == 2


def test_a_batch_without_changes_holds_empty_read_only_mappings() -> None:
    batch = make_batch({3: (None, 1, 8)}, (), {}, {}, {}, frozenset(), frozenset())
    assert batch == ScheduledBatch((3,), (1,), 1, (), (8,))
    for name in ("new_tokens", "block_changes", "drafts"):
        mapping = getattr(batch, name)
        assert len(mapping) == 0 and not hasattr(mapping, "__setitem__"), name


def test_a_new_request_carries_the_prompt_it_arrived_with_not_a_copy() -> None:
    """The prompt is made a tuple once, when the request arrives: the message carries that tuple, a later
    change to the caller's list reaches neither, and the forks of an ``n > 1`` request share it."""
    from corerun.core.scheduler import Scheduler
    from corerun.core.sequence import Sequence
    from corerun.engine.parallel_sampling import fork
    from corerun.kv_cache.paged import PagedKVCacheManager

    rng = random.Random(3)
    given = [rng.randrange(32000) for _ in range(37)]
    expected = tuple(int(t) for t in given)  # the values as they were when the request arrived
    head = Sequence(seq_id=1, request_id="r", prompt_token_ids=given, params=SamplingParams(n=2, max_tokens=3))
    given[0] = given[0] + 1  # the caller's list changes after the request arrived
    group = fork(head, iter(range(2, 10)).__next__)
    sched = Scheduler(PagedKVCacheManager(num_blocks=16, block_size=8), max_num_seqs=4, max_num_batched_tokens=256)
    for seq in group.seqs:
        sched.add(seq)
    batch = sched.schedule()
    assert [r.seq_id for r in batch.new_reqs] == [1, 2]
    for r, seq in zip(batch.new_reqs, group.seqs):
        assert type(r.prompt_token_ids) is tuple and r.prompt_token_ids == expected and r.output_token_ids == ()
        assert r.prompt_token_ids is seq.prompt_token_ids is head.prompt_token_ids
    assert pickle.loads(pickle.dumps(batch)).new_reqs == batch.new_reqs
    assert head.token_ids == list(expected) and head.num_prompt_tokens == 37
