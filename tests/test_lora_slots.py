"""LoRA bookkeeping below the engine: device slots (corerun.lora.slots) and adapter-keyed prefix blocks."""

from __future__ import annotations

import pytest

from corerun.kv_cache.paged import PagedKVCacheManager, chained_hash
from corerun.lora.slots import LoRASlots


def test_slots_pin_while_used_reuse_when_idle_and_evict_least_recently_idle():
    slots = LoRASlots(2)
    assert slots.acquire(11) == 0 and slots.acquire(12) == 1
    assert slots.acquire(13) is None and not slots.available(13)  # both pinned by other adapters
    assert slots.acquire(11) == 0  # a second user of the same adapter shares its slot
    slots.release(0)
    assert slots.acquire(13) is None  # slot 0 still has a user
    slots.release(0)
    slots.release(1)  # 0 idle first, then 1
    assert slots.available(13) and slots.acquire(13) == 0  # least recently idle evicted
    assert slots.slot_of == {12: 1, 13: 0}
    assert slots.acquire(12) == 1  # idle slot reused with its adapter still in place
    with pytest.raises(ValueError, match="slot 1 released with no running user"):
        slots.release(1), slots.release(1)
    assert not slots.forget(13) and slots.num_pinned == 1


@pytest.mark.parametrize("hash_fn", [chained_hash, lambda parent, tokens: 0])  # (a constant hash: every key collides)
def test_prefix_blocks_are_never_shared_across_extra_keys(hash_fn):
    kv = PagedKVCacheManager(32, 4, hash_fn=hash_fn)
    prompt = [7, 3, 9, 1, 4, 4, 2, 8, 5]
    owners = {0: None, 1: ("lora", 1), 2: ("lora", 2)}
    for sid, key in owners.items():
        kv.set_extra_key(sid, key)
        assert kv.get_computed_prefix(sid, prompt) == 0  # nothing cached under this key yet
        kv.allocate_slots(sid, len(prompt))
        kv.cache_blocks(sid, prompt, len(prompt))
    tables = [set(kv.block_table(s)) for s in owners]
    assert not (tables[0] & tables[1]) and not (tables[0] & tables[2]) and not (tables[1] & tables[2])
    kv.set_extra_key(3, ("lora", 2))  # the same adapter again: its prefix is found
    assert kv.get_computed_prefix(3, prompt) == (8 if hash_fn is chained_hash else 0)  # (collisions: never served)
    assert set(kv.block_table(3)) <= tables[2]
    for sid in range(4):
        kv.free(sid)
    assert kv.num_free_blocks == 32


def test_scheduler_admits_in_arrival_order_so_no_adapter_starves_behind_another():
    from corerun.core.scheduler import Scheduler
    from corerun.core.sequence import Sequence
    from corerun.lora.request import LoRARequest
    from corerun.sampling_params import SamplingParams

    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    sched = Scheduler(PagedKVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, max_loras=1)
    params = SamplingParams(max_tokens=4)
    seqs = [Sequence(i, f"r{i}", [3, 1, 4, 1, 5], params, lora=lora) for i, lora in enumerate([a, b, a, None])]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch.req_ids == (0,)  # b holds the head: a's second request and the base one wait behind it
    assert [(r.lora, r.lora_slot) for r in batch.new_reqs] == [(a, 0)]
    sched.finish(seqs[0], "stop")  # a's slot goes idle: b takes it
    batch = sched.schedule()
    assert batch.req_ids == (1,) and [(r.lora, r.lora_slot) for r in batch.new_reqs] == [(b, 0)]
    assert sched.lora_slots.slot_of == {2: 0} and sched.lora_slots.num_pinned == 1
    sched.finish(seqs[1], "stop")
    batch = sched.schedule()
    assert set(batch.req_ids) == {2, 3} and {r.seq_id: r.lora_slot for r in batch.new_reqs} == {2: 0, 3: -1}
    for s in seqs[2:]:
        sched.finish(s, "stop")
    assert sched.lora_slots.num_pinned == 0 and not sched.lora_slot_of
