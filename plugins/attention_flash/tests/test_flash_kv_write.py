"""``write_kv_by_slot``: exactly the named slots change, ``-1`` writes nothing, whatever the order of padding."""

from __future__ import annotations

import pytest
import torch

from corerun_attention_flash.kv_write import write_kv_by_slot

NUM_BLOCKS, BLOCK, HKV, D = 4, 8, 2, 16


def expected_after(cache: torch.Tensor, key, value, slots: list[int]) -> torch.Tensor:
    """Slot by slot, in plain Python: the cache after writing every real token."""
    want = cache.clone()
    for i, slot in enumerate(slots):
        if slot >= 0:
            want[0, slot // BLOCK, slot % BLOCK] = key[i]
            want[1, slot // BLOCK, slot % BLOCK] = value[i]
    return want


@pytest.mark.parametrize(
    "slots",
    [
        [5, 17, 0, 31],  # no padding
        [-1, 0, -1, 9],  # padding first, a real token on slot 0 (the fallback slot)
        [3, -1, -1, 0],  # padding between real tokens, slot 0 last
        [-1, -1, -1],  # padding only: nothing changes
        [-1, 12, 31, -1, 30, -1],
    ],
    ids=["real", "pad-first-slot0", "pad-middle", "pad-only", "scattered"],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_writes_exactly_the_real_slots(slots, dtype):
    g = torch.Generator().manual_seed(len(slots))
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, HKV, D, generator=g).to(dtype)
    key = torch.randn(len(slots), HKV, D, generator=g).to(dtype)
    value = torch.randn(len(slots), HKV, D, generator=g).to(dtype)
    want = expected_after(cache, key, value, slots)
    write_kv_by_slot(key, value, cache, torch.tensor(slots, dtype=torch.int64))
    assert torch.equal(cache, want)


def test_accepts_strided_key_value_views():
    """K/V sliced out of a fused QKV projection are not contiguous."""
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, HKV, D, generator=g)
    qkv = torch.randn(3, 3 * HKV, D, generator=g)
    key, value = qkv[:, HKV:2 * HKV], qkv[:, 2 * HKV:]
    slots = [7, -1, 20]
    want = expected_after(cache, key, value, slots)
    write_kv_by_slot(key, value, cache, torch.tensor(slots))
    assert torch.equal(cache, want)


def test_empty_step_and_length_mismatch():
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK, HKV, D)
    write_kv_by_slot(torch.empty(0, HKV, D), torch.empty(0, HKV, D), cache, torch.empty(0, dtype=torch.int64))
    assert not cache.any()
    with pytest.raises(ValueError, match="one row per slot_mapping entry"):
        write_kv_by_slot(torch.ones(3, HKV, D), torch.ones(3, HKV, D), cache, torch.tensor([0, 1]))
