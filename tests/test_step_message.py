"""The step message as the scheduler builds it (``make_batch``): the same value as the dataclass's own
constructor gives, decodes first, frozen, and whole after pickling (tensor-parallel rank 0 sends it)."""

from __future__ import annotations

import dataclasses
import pickle
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
