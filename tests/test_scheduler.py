"""The scheduler's rules, driven by a simulated model (each step "computes" what was scheduled)."""

from __future__ import annotations

import random

from corerun.core.scheduler import Scheduler
from corerun.core.sequence import Sequence, SequenceStatus
from corerun.kv_cache.paged import PagedKVCacheManager
from corerun.sampling_params import SamplingParams


def _seq(i: int, n: int, max_tokens: int = 4) -> Sequence:
    return Sequence(seq_id=i, request_id=str(i), prompt_token_ids=list(range(100 * i, 100 * i + n)), params=SamplingParams(max_tokens=max_tokens))


def _run(sched: Scheduler, seqs: list[Sequence], max_steps: int = 10_000) -> list[tuple[list[int], list[int], int]]:
    """Step until everything finished; returns (seq ids, num_new, num_decodes) per step."""
    for s in seqs:
        sched.add(s)
    log = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return log
        decoding = {s.seq_id for s in sched.running if s.num_computed_tokens >= s.num_prompt_tokens}
        b = sched.schedule()
        assert b, "nothing schedulable while requests wait: a hang"
        # a sequence past its prompt computes exactly one token, among the leading num_decodes rows
        for row, (s, n) in enumerate(zip(sched.seqs_of(b), b.num_scheduled)):
            if s.seq_id in decoding:
                assert n == 1 and row < b.num_decodes, (s.seq_id, n, row, b.num_decodes)
        assert b.num_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        log.append((list(b.req_ids), list(b.num_scheduled), b.num_decodes))
        for s, n in zip(sched.seqs_of(b), b.num_scheduled):
            # every scheduled token has a slot
            assert len(sched.kv.block_table(s.seq_id)) * sched.kv.block_size >= s.num_computed_tokens + n
            s.num_computed_tokens += n
            sched.kv.cache_blocks(s.seq_id, s.token_ids, s.num_computed_tokens)
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(7)
                if s.num_output_tokens >= s.params.max_tokens:
                    sched.finish(s, "length")
    raise AssertionError("did not finish")


def test_decodes_first_and_budget_respected():
    kv = PagedKVCacheManager(64, 4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=10)
    seqs = [_seq(i, n) for i, n in enumerate([3, 17, 5, 9])]
    log = _run(sched, seqs)
    for ids, num_new, nd in log:
        assert all(n == 1 for n in num_new[:nd]) and all(n != 1 for n in num_new[nd:])
    assert all(s.status is SequenceStatus.FINISHED and s.num_output_tokens == 4 for s in seqs)
    assert kv.num_free_blocks == 64


def test_long_prompt_is_chunked_and_mixed_with_decodes():
    kv = PagedKVCacheManager(64, 4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=6)
    short, long = _seq(0, 2, max_tokens=8), _seq(1, 23)
    log = _run(sched, [short, long])
    chunks = [n for ids, num_new, _ in log for sid, n in zip(ids, num_new) if sid == 1 and n > 1]
    assert sum(chunks) == 23 and max(chunks) <= 6 and len(chunks) >= 4
    mixed = [step for step in log if 0 in step[0] and 1 in step[0] and step[2] >= 1 and len(step[1]) > step[2]]
    assert mixed, "a decode should share a step with a prefill chunk"


def test_preemption_recomputes_and_never_loses_a_request():
    kv = PagedKVCacheManager(10, 4)  # 40 token slots for 6 requests of up to 17 tokens
    sched = Scheduler(kv, max_num_seqs=6, max_num_batched_tokens=64)
    seqs = [_seq(i, n, max_tokens=6) for i, n in enumerate([9, 11, 5, 7, 10, 3])]
    _run(sched, seqs)
    assert sched.num_preemptions > 0
    assert all(s.is_finished and s.num_output_tokens == 6 for s in seqs)
    assert kv.num_free_blocks == 10


def test_without_chunking_prompts_wait_for_a_whole_step():
    kv = PagedKVCacheManager(64, 4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=12, chunked_prefill=False)
    log = _run(sched, [_seq(0, 10), _seq(1, 11)])
    for ids, num_new, nd in log:
        prefills = [n for n in num_new if n > 1]
        assert all(n in (10, 11) for n in prefills)


def test_random_workloads_finish_and_free_everything():
    rng = random.Random(0)
    for trial in range(20):
        nb = rng.randint(8, 20)
        kv = PagedKVCacheManager(nb, 4)
        sched = Scheduler(kv, max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(4, 40))
        seqs = []
        for i in range(rng.randint(1, 10)):
            n, m = rng.randint(1, 14), rng.randint(1, 10)
            if -(-(n + m) // 4) <= nb:  # the engine rejects requests that can never fit
                seqs.append(_seq(i, n, max_tokens=m))
        _run(sched, seqs)
        assert all(s.is_finished for s in seqs)
        assert kv.num_free_blocks == nb


def test_prefix_stats_count_a_waiting_request_once():
    """A request that waits several steps for blocks (lookup, failed allocation, release) is counted once."""
    kv = PagedKVCacheManager(num_blocks=6, block_size=4, prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    first = _seq(1, 16, max_tokens=3)  # 4 blocks, then a 5th for its outputs
    shared = first.prompt_token_ids[:8]  # its first two full blocks
    second = Sequence(seq_id=2, request_id="2", prompt_token_ids=[*shared, *range(900, 912)], params=SamplingParams(max_tokens=1))
    sched.add(first)
    sched.add(second)
    waited = 0
    while sched.has_unfinished():
        b = sched.schedule()
        waited += second in sched.waiting
        for s, n in zip(sched.seqs_of(b), b.num_scheduled):
            s.num_computed_tokens += n
            kv.cache_blocks(s.seq_id, s.token_ids, s.num_computed_tokens)
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(7)
                if s.num_output_tokens >= s.params.max_tokens:
                    sched.finish(s, "length")
    assert waited >= 2  # the second prompt really was refused (and looked up) on several steps
    stats = kv.stats()
    assert stats.prefix_queries == 16 + 20
    assert stats.prefix_hits == 8  # the second prompt found the first's two full blocks, once


def test_each_batch_states_what_changed_since_the_previous_one():
    """Protocol version 3, step by step on a tiny cache (blocks of 4): a new sequence comes with its
    whole table, a decode with no entry until it crosses into a new block (then that block only), a
    preempted one comes back with a whole new table among ``resumed_ids``, a finished one is named
    once in the next batch's ``finished_ids``.  Tables are the manager's own ``block_table``."""
    kv = PagedKVCacheManager(5, 4, prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _seq(1, 6, max_tokens=30), _seq(2, 7, max_tokens=30)
    sched.add(a)
    sched.add(b)

    def step():
        batch = sched.schedule()
        for s, n in zip(sched.seqs_of(batch), batch.num_scheduled):
            s.num_computed_tokens += n
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(7)
        return batch

    first = step()  # a: 6 tokens (2 blocks), b: 7 tokens (2 blocks)
    assert first.new_block_ids == {1: (0, tuple(kv.block_table(1))), 2: (0, tuple(kv.block_table(2)))}
    assert len(kv.block_table(1)) == 2 and not first.resumed_ids and not first.finished_ids
    # new requests in full, nothing else: their prompts, parameters and computed counts
    assert [(r.seq_id, r.prompt_token_ids, r.output_token_ids, r.num_computed_tokens) for r in first.new_reqs] == [
        (1, tuple(range(100, 106)), (), 0), (2, tuple(range(200, 207)), (), 0)]
    assert not first.new_tokens and first.num_scheduled == (6, 7) and first.num_computed == (0, 0)
    second = step()  # decodes at positions 6 and 7: no new block
    assert second.new_block_ids == {} and second.num_computed == (6, 7)
    # the others as changes: the token each got since it was last scheduled (7, at the prompt's end),
    # which the runner did not sample (this test appended it)
    assert dict(second.new_tokens) == {1: (6, (7,), 7), 2: (7, (7,), 8)}
    third = step()  # positions 7 (a) and 8 (b): b crosses into its third block, the last free one
    assert third.new_block_ids == {2: (2, tuple(kv.block_table(2)[2:]))} and len(kv.block_table(2)) == 3
    fourth = step()  # a needs a third block at position 8: none free, b (the youngest) is preempted
    assert fourth.preempted_ids == {2} and list(fourth.req_ids) == [1]
    assert fourth.new_block_ids == {1: (2, tuple(kv.block_table(1)[2:]))}
    sched.finish(a, "stop")
    fifth = step()  # b recomputed from scratch into a new table, and a reported finished
    assert fifth.finished_ids == {1} and fifth.resumed_ids == {2}
    assert fifth.new_block_ids == {2: (0, tuple(kv.block_table(2)))}
    (back,) = fifth.new_reqs  # resumed: its prompt and the output it had, in full
    assert back.resumed and back.prompt_token_ids == tuple(range(200, 207)) and back.output_token_ids == (7, 7, 7)
    assert step().finished_ids == frozenset()  # named once


def test_decodes_the_runner_sampled_for_are_told_their_computed_counts_only():
    """vLLM v1's cached requests: a request the runner holds, whose tokens it sampled itself (they come
    back in the step's result) and whose table kept its length, costs its row and nothing else."""
    from corerun.core.batch import StepResult

    rng = random.Random(5)
    kv = PagedKVCacheManager(64, 4, prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(3):
        sched.add(_seq(i, rng.randint(3, 9), max_tokens=30))
    batch, grew = sched.schedule(), 0
    for _ in range(10):
        tables = {sid: len(kv.block_table(sid)) for sid in batch.req_ids}
        rows = list(range(len(batch.req_ids)))
        sched.update_from_output(batch, StepResult([rng.randrange(1000) for _ in rows], rows, None, {}))
        batch = sched.schedule()
        assert batch.num_decodes == 3 and not batch.new_reqs and not batch.new_tokens
        assert batch.num_computed == tuple(s.num_computed_tokens for s in sched.seqs_of(batch))
        crossed = {sid for sid in batch.req_ids if len(kv.block_table(sid)) > tables[sid]}
        assert dict(batch.block_changes) == {sid: (tables[sid], tuple(kv.block_table(sid)[tables[sid]:])) for sid in crossed}
        grew += len(crossed)
    assert grew >= 3  # (each crossed into a new block of 4 at least once)


def test_a_trim_is_stated_and_merged_with_the_growth_after_it():
    kv = PagedKVCacheManager(16, 4, prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    a = _seq(1, 5, max_tokens=30)
    sched.add(a)
    first = sched.schedule()
    a.num_computed_tokens = 5
    a.token_ids.append(7)
    assert sched._allocate(a, 14) and len(kv.block_table(1)) == 4  # drafts took two more blocks
    sched.trim(a, 6)  # all rejected: back to 2 blocks
    assert len(kv.block_table(1)) == 2
    a.token_ids += [8, 9, 10]  # (accepted later: grows into a third block)
    a.num_computed_tokens = 8
    second = sched.schedule()
    table = kv.block_table(1)
    assert len(table) == 3 and first.new_block_ids[1].start == 0
    replay = second.new_block_ids[1].apply(first.new_block_ids[1].ids)
    assert replay == table  # the drafts' blocks gone, the new one appended
