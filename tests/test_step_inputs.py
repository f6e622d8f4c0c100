"""Step inputs filled from the runner's persistent batch, against a per-token reference.

The reference below is written independently, the straightforward way: Python loops over the
scheduler's own sequences and their tokens, with block ids from the KV-cache manager's
``block_table``.  The runner side sees only the messages: a real ``Scheduler`` over a real ``paged``
manager runs many steps (prompt chunks, decodes, drafts all rejected, preemption and recompute,
prefix hits, finishing), each batch is applied to an ``InputBatch`` made deliberately small (so rows,
token columns and block columns all grow), and the tokens sampled are recorded as the runner does.
The staging buffer is poisoned before each step, so an element left unwritten would show.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from corerun.core.batch import NewRequest, ScheduledBatch, StepResult
from corerun.core.scheduler import Scheduler
from corerun.core.sequence import Sequence
from corerun.kv_cache.paged import PagedKVCacheManager
from corerun.runner.input_batch import InputBatch
from corerun.runner.step_inputs import StepInputs
from corerun.sampling_params import SamplingParams

BS = 4


def _reference(seqs: list[Sequence], sched: ScheduledBatch, kv: PagedKVCacheManager) -> dict:
    ref: dict = {k: [] for k in ("input_ids", "positions", "slot_mapping", "seq_lens", "context_lens", "sampled", "logits")}
    qsl = [0]
    tables = []
    for i, (s, n) in enumerate(zip(seqs, sched.num_scheduled)):
        tokens = s.token_ids + list(sched.drafts.get(s.seq_id, ()))
        c = s.num_computed_tokens
        table = kv.block_table(s.seq_id)
        for p in range(c, c + n):
            ref["input_ids"].append(tokens[p])
            ref["positions"].append(p)
            ref["slot_mapping"].append(table[p // BS] * BS + p % BS)
        qsl.append(qsl[-1] + n)
        ref["seq_lens"].append(c + n)
        ref["context_lens"].append(c)
        tables.append(table)
        if c + n >= s.num_tokens:
            ref["sampled"].append(i)
            ref["logits"].append(qsl[-1] - 1)
    width = max(len(t) for t in tables)
    ref["block_tables"] = [t + [0] * (width - len(t)) for t in tables]
    ref["query_start_loc"] = qsl
    return ref


def _check(out, ref: dict) -> None:
    inputs, rows, logits = out
    b = inputs.batch
    have = {
        "input_ids": inputs.input_ids, "positions": inputs.positions, "slot_mapping": b.slot_mapping,
        "seq_lens": b.seq_lens, "context_lens": b.context_lens, "block_tables": b.block_tables,
        "query_start_loc": b.query_start_loc,
    }
    for name, t in have.items():
        assert t.tolist() == ref[name], name
    assert rows.tolist() == ref["sampled"] and logits.tolist() == ref["logits"]
    assert inputs.lora_slots.tolist() == [-1] * len(ref["input_ids"])  # (no adapters: every token's slot written, -1)
    assert b.max_seq_len == max(ref["seq_lens"]) and b.num_tokens == len(ref["input_ids"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("small_batch", [0, 16], ids=["vectorised", "lists"])
def test_many_steps_of_messages_match_the_reference(seed: int, small_batch: int) -> None:
    """(``small_batch``: decode steps of up to that many requests are filled from Python lists; 0: never.)"""
    rng = random.Random(seed)
    kv = PagedKVCacheManager(18, BS, prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=14, max_model_len=200)
    ib = InputBatch(BS, rows=1, width=2, table_width=1)  # everything grows
    si = StepInputs(BS, "cpu", max_num_tokens=4, max_num_reqs=1, max_blocks_per_seq=1)  # and the staging buffer
    si.small_batch = small_batch
    shared = [rng.randrange(1000) for _ in range(2 * BS)]
    seen = {"drafts": 0, "resumed": 0, "steps": 0}
    next_id = 0
    for step in range(150):
        while len(sched) < 7 and rng.random() < 0.4:
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(1000) for _ in range(rng.randint(1, 3 * BS))]
            sched.add(Sequence(next_id, str(next_id), prompt, SamplingParams(max_tokens=rng.randint(1, 12))))
            next_id += 1
        sched.update_draft_token_ids({s.seq_id: [rng.randrange(1000) for _ in range(rng.randint(1, 3))]
                                      for s in sched.running if rng.random() < 0.3})
        batch = sched.schedule()
        if not batch:
            continue
        seqs = sched.seqs_of(batch)
        ref = _reference(seqs, batch, kv)  # (the sequences as scheduled, before anything runs)
        ib.apply(batch)
        for sid, d in batch.drafts.items():
            ib.write_drafts(ib.index[sid], d)
        if seen["steps"] == 0:  # poisoned once: what a step keeps from its buffer's last step must still be right
            for staging in si._buffers:
                staging.host_np.fill(0xA5)
        out = si.build(batch, ib)
        _check(out, ref)
        seen["steps"] += 1
        seen["drafts"] += len(batch.drafts)
        seen["resumed"] += len(batch.resumed_ids)
        # the step "ran": every draft rejected, a random token sampled, recorded as the runner records it
        rows = out[1].tolist()
        tokens = [rng.randrange(1000) for _ in rows]
        for r, t in zip(rows, tokens):
            ib.record(ib.index[batch.req_ids[r]], [t])
        sched.update_from_output(batch, StepResult(tokens, rows, None, {}))
    assert seen["steps"] > 100 and seen["drafts"] > 10 and seen["resumed"] > 0 and sched.num_preemptions > 0, seen
    assert kv.stats().prefix_hits > 0
    assert ib.token_ids.shape[0] > 1 and ib.token_ids.shape[1] > 2 and ib.block_table.shape[1] > 1


@pytest.mark.parametrize("small_batch", [0, 16], ids=["vectorised", "lists"])
def test_steady_decodes_keep_what_did_not_change_and_rewrite_the_tables_that_did(small_batch: int) -> None:
    """The same requests decoding step after step (the buffers alternate; tables grow every few steps,
    a request is preempted and resumed into another row): every step equals the reference."""
    rng = random.Random(7)
    kv = PagedKVCacheManager(40, BS, prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=200)
    ib, si = InputBatch(BS), StepInputs(BS, "cpu", max_num_tokens=64, max_num_reqs=3, max_blocks_per_seq=16)
    si.small_batch = small_batch
    for i in range(3):
        sched.add(Sequence(i, str(i), [rng.randrange(1000) for _ in range(3 + 2 * i)], SamplingParams(max_tokens=40)))
    for b in si._buffers:
        b.host_np.fill(0xA5)
    for step in range(30):
        if step == 12:  # request 1 leaves and comes back: its row, table and slots change under the same ids
            victim = next(s for s in sched.running if s.seq_id == 1)
            sched._preempt(victim)
        _decode_step(sched, kv, ib, si, rng)


def _decode_step(sched: Scheduler, kv: PagedKVCacheManager, ib: InputBatch, si: StepInputs, rng: random.Random) -> None:
    """One step scheduled, applied, built and checked against the reference; then "run": a random token
    sampled per sampled row, recorded as the runner records it."""
    batch = sched.schedule()
    ref = _reference(sched.seqs_of(batch), batch, kv)
    out = si.build(batch, ib, ib.apply(batch))
    _check(out, ref)
    sampled = out[1].tolist()
    tokens = [rng.randrange(1000) for _ in sampled]
    for r, t in zip(sampled, tokens):
        ib.record(ib.index[batch.req_ids[r]], [t])
    sched.update_from_output(batch, StepResult(tokens, sampled, None, {}))


def _one(seq_id: int, prompt: int, blocks: tuple[int, ...], computed: int = 0) -> NewRequest:
    return NewRequest(seq_id, tuple(range(prompt)), (), SamplingParams(), blocks, computed)


def test_refusals_say_what_was_wrong() -> None:
    si = StepInputs(BS, "cpu", max_num_tokens=8, max_num_reqs=2, max_blocks_per_seq=2)
    ib = InputBatch(BS)
    with pytest.raises(ValueError, match="empty scheduled batch"):
        si.build(ScheduledBatch((), (), 0), ib)
    with pytest.raises(ValueError, match="power of two.*got 12"):
        StepInputs(12, "cpu", max_num_tokens=8, max_num_reqs=2, max_blocks_per_seq=2)
    with pytest.raises(ValueError, match="request 7 is scheduled but the runner holds no row"):
        si.build(ScheduledBatch((7,), (1,), 1), ib)
    short = ScheduledBatch((3,), (6,), 0, new_reqs=(_one(3, 6, (5,)),))
    ib.apply(short)
    with pytest.raises(ValueError, match="request 3's block table has 1 blocks, but this step reaches 6 tokens, which need 2"):
        si.build(short, ib)
    zero = ScheduledBatch((4,), (0,), 0, new_reqs=(_one(4, 3, (1,)),))
    ib.apply(zero)
    with pytest.raises(ValueError, match="request 4 is scheduled 0 tokens"):
        si.build(zero, ib)


@pytest.mark.parametrize("small_batch", [0, 16], ids=["vectorised", "lists"])
def test_a_decode_past_its_table_is_refused_by_name(small_batch: int) -> None:
    si = StepInputs(BS, "cpu", max_num_tokens=8, max_num_reqs=2, max_blocks_per_seq=2)
    si.small_batch = small_batch
    ib = InputBatch(BS)
    decode = ScheduledBatch((2, 3), (1, 1), 2, new_reqs=(_one(2, 3, (4,), computed=2), _one(3, 5, (5,), computed=4)))
    ib.apply(decode)
    with pytest.raises(ValueError, match="request 3's block table has 1 blocks, but this step reaches 5 tokens, which need 2"):
        si.build(decode, ib)


def test_a_change_to_a_request_the_runner_never_held_is_refused_by_name() -> None:
    from types import MappingProxyType

    from corerun.core.batch import BlockIds, NewTokens

    ib = InputBatch(BS)
    with pytest.raises(ValueError, match=r"request 9 is sent as a change \(new_tokens\)"):
        ib.apply(ScheduledBatch((9,), (1,), 1, num_computed=(0,), new_tokens=MappingProxyType({9: NewTokens(0, (1,), 1)})))
    with pytest.raises(ValueError, match=r"request 8 is sent as a change \(block_changes\)"):
        ib.apply(ScheduledBatch((8,), (1,), 1, num_computed=(0,), block_changes=MappingProxyType({8: BlockIds(0, (3,))})))
    ib.apply(ScheduledBatch((1,), (5,), 0, new_reqs=(_one(1, 5, (8, 9)),)))
    with pytest.raises(ValueError, match="gives no computed counts"):
        ib.apply(ScheduledBatch((1,), (1,), 1))


def test_finished_and_preempted_requests_leave_and_a_resumed_one_comes_back_whole() -> None:
    ib = InputBatch(BS, rows=2)
    ib.apply(ScheduledBatch((1, 2), (5, 3), 0, new_reqs=(_one(1, 5, (8, 9)), _one(2, 3, (4,)))))
    assert ib.blocks(1) == [8, 9] and ib.tokens(2) == [0, 1, 2]
    ib.apply(ScheduledBatch((), (), 0, finished_ids=frozenset({1}), preempted_ids=frozenset({2})))
    assert len(ib) == 0 and ib.blocks(1) == [] and not ib.block_table.any()  # a free row's table is zeros
    back = NewRequest(2, (0, 1, 2), (7, 7), SamplingParams(), (6,), 4, resumed=True)
    ib.apply(ScheduledBatch((2,), (1,), 1, new_reqs=(back,)))
    assert ib.tokens(2) == [0, 1, 2, 7, 7] and ib.blocks(2) == [6] and ib.num_computed[ib.index[2]] == 4


class RecordingFence:
    """A fence for CPU: remembers the staged bytes at ``record``; ``synchronize`` checks they are still there."""

    def __init__(self, si: list) -> None:
        self.si, self.recorded, self.waits = si, None, 0

    def _bytes(self) -> np.ndarray:
        return next(b.host_np for b in self.si[0]._buffers if b.fence is self)

    def record(self) -> None:
        self.recorded = self._bytes().copy()

    def synchronize(self) -> None:
        self.waits += 1
        assert np.array_equal(self._bytes(), self.recorded), "the buffer was written before the wait"


def test_a_step_s_inputs_hold_while_the_next_is_built_and_its_buffer_waits_for_its_copy() -> None:
    holder: list = []
    fences = (RecordingFence(holder), RecordingFence(holder))
    si = StepInputs(BS, "cpu", max_num_tokens=64, max_num_reqs=4, max_blocks_per_seq=4, fences=fences)
    holder.append(si)
    ib = InputBatch(BS)
    steps = [ScheduledBatch((k,), (5 + k,), 0, new_reqs=(_one(k, 5 + k, (k, k + 10)),)) for k in range(3)]
    ib.apply(steps[0])
    in_flight = si.build(steps[0], ib)[0]  # (not copied: what a step running on another thread holds)
    ib.apply(steps[1])
    si.build(steps[1], ib)
    assert in_flight.input_ids.tolist() == [0, 1, 2, 3, 4] and in_flight.positions.tolist() == [0, 1, 2, 3, 4]
    assert in_flight.batch.slot_mapping.tolist() == [0, 1, 2, 3, 10 * BS]
    assert [f.waits for f in fences] == [0, 0]  # nothing was pending before each buffer's first step
    ib.apply(steps[2])
    si.build(steps[2], ib)  # back to the first buffer: only after the copy out of it
    assert [f.waits for f in fences] == [1, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging and the CUDA event need a GPU")
def test_cuda_pinned_staging_matches_the_host_fill() -> None:
    si = StepInputs(BS, "cuda", max_num_tokens=64, max_num_reqs=8, max_blocks_per_seq=8)
    assert all(b.host.is_pinned() for b in si._buffers)
    ib = InputBatch(BS)
    outs = []
    for k in range(4):  # the next build reuses the buffer while this copy may be in flight
        batch = ScheduledBatch((k,), (5 + k,), 0, new_reqs=(_one(k, 5 + k, (k, k + 10, k + 20)),))
        ib.apply(batch)
        outs.append(si.build(batch, ib)[0])
    torch.cuda.synchronize()
    for k, inputs in enumerate(outs):
        assert inputs.input_ids.device.type == "cuda" and inputs.input_ids.tolist() == list(range(5 + k))
        assert inputs.batch.slot_mapping.tolist() == [(k if p < BS else k + 10) * BS + p % BS for p in range(5 + k)]


def test_rows_of_a_steady_batch_are_kept_until_a_request_moves() -> None:
    ib = InputBatch(BS, rows=4)
    ib.apply(ScheduledBatch((1, 2), (5, 3), 0, new_reqs=(_one(1, 5, (8, 9)), _one(2, 3, (4,)))))
    first = ib.rows_of((1, 2))
    assert first.tolist() == [ib.index[1], ib.index[2]] and ib.rows_of((1, 2)) is first and not first.flags.writeable
    # request 1 leaves, another request takes its row, and 1 comes back into a third one
    ib.apply(ScheduledBatch((3,), (2,), 0, new_reqs=(_one(3, 2, (5,)),), preempted_ids=frozenset({1})))
    ib.apply(ScheduledBatch((1,), (5,), 0, new_reqs=(_one(1, 5, (6, 7)),)))
    assert ib.rows_of((1, 2)).tolist() == [ib.index[1], ib.index[2]] != first.tolist()


@pytest.mark.parametrize("small_batch", [0, 16], ids=["vectorised", "lists"])
def test_decodes_whose_tables_all_grow_on_the_same_step_match_the_reference(small_batch: int) -> None:
    """Eleven requests of one prompt length cross into a new block together: most rows of a steady
    decode batch are rewritten at once (more than a few: one gather)."""
    rng = random.Random(11)
    kv = PagedKVCacheManager(80, BS, prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=12, max_num_batched_tokens=64, max_model_len=200)
    ib, si = InputBatch(BS), StepInputs(BS, "cpu", max_num_tokens=64, max_num_reqs=12, max_blocks_per_seq=16)
    si.small_batch = small_batch
    for i in range(12):  # (the first, longer, holds the widest table: the others grow without widening the step's)
        length = 4 * BS + 1 if i == 0 else 2 * BS - 1
        sched.add(Sequence(i, str(i), [rng.randrange(1000) for _ in range(length)], SamplingParams(max_tokens=12)))
    for _ in range(12):
        _decode_step(sched, kv, ib, si, rng)


@pytest.mark.parametrize("small_batch", [0, 16], ids=["vectorised", "lists"])
def test_each_token_carries_its_request_s_adapter_slot(small_batch: int) -> None:
    si = StepInputs(BS, "cpu", max_num_tokens=16, max_num_reqs=4, max_blocks_per_seq=4)
    si.small_batch = small_batch
    ib = InputBatch(BS)
    reqs = [NewRequest(k, tuple(range(3 + k)), (), SamplingParams(), (k, k + 5), 0, lora_slot=slot) for k, slot in enumerate((2, -1, 0))]
    prefill = ScheduledBatch((0, 1, 2), (3, 4, 5), 0, new_reqs=tuple(reqs))
    out = si.build(prefill, ib, ib.apply(prefill))[0]
    assert out.lora_slots.tolist() == [2] * 3 + [-1] * 4 + [0] * 5
    decode = ScheduledBatch((2, 0), (1, 1), 2, num_computed=(4, 2))  # (their last prompt token again)
    out = si.build(decode, ib, ib.apply(decode))[0]
    assert out.lora_slots.tolist() == [0, 2] and out.input_ids.tolist() == [4, 2]
