"""``Scheduler.update_from_output``: a step's result applied by the scheduler, checked against hand-worked answers."""

from __future__ import annotations

from corerun.core.batch import StepResult
from corerun.core.scheduler import Scheduler
from corerun.core.sequence import Sequence
from corerun.engine.output_processor import OutputProcessor
from corerun.kv_cache.paged import PagedKVCacheManager
from corerun.sampling_params import SamplingParams


def _seq(i: int, prompt: list[int], **params) -> Sequence:
    return Sequence(seq_id=i, request_id=str(i), prompt_token_ids=prompt, params=SamplingParams(**params))


def _prefill(sched: Scheduler, *seqs: Sequence) -> None:
    """Admit and compute every prompt, sampling token 9 for each."""
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    rows = list(range(len(batch.req_ids)))
    sched.update_from_output(batch, StepResult([9] * len(rows), rows, None, {}))


def test_tokens_stop_tokens_and_length_end_requests_with_their_reason():
    kv = PagedKVCacheManager(32, 4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, eos_token_ids=frozenset({2}))
    a, b, c = _seq(0, [5, 6, 7]), _seq(1, [5, 6], stop_token_ids=[11]), _seq(2, [8], max_tokens=2)
    _prefill(sched, a, b, c)
    assert [s.output_token_ids for s in (a, b, c)] == [[9], [9], [9]]
    assert [s.num_computed_tokens for s in (a, b, c)] == [3, 2, 1]
    batch = sched.schedule()
    assert batch.num_decodes == 3
    touched, failed = sched.update_from_output(batch, StepResult([2, 11, 4], [0, 1, 2], None, {}))
    assert failed == {} and touched == [a, b, c]
    assert (a.finish_reason, a.stop_reason, a.output_token_ids) == ("stop", None, [9, 2])  # eos
    assert (b.finish_reason, b.stop_reason, b.output_token_ids) == ("stop", 11, [9, 11])  # a stop token
    assert (c.finish_reason, c.output_token_ids) == ("length", [9, 4])  # max_tokens=2
    assert sched.num_generated_tokens == 6 and not sched.has_unfinished()
    assert kv.num_free_blocks == 32  # every block freed


def test_accepted_drafts_are_appended_and_the_rejected_ones_give_back_their_blocks():
    kv = PagedKVCacheManager(32, 4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    a = _seq(0, [1, 2, 3], max_tokens=50)
    _prefill(sched, a)  # tokens: 1 2 3 9, three computed
    sched.update_draft_token_ids({0: [4, 5, 6, 7, 8]})
    batch = sched.schedule()
    assert batch.drafts == {0: (4, 5, 6, 7, 8)} and batch.num_scheduled == (6,)
    assert len(kv.block_table(0)) == 3  # room for 3 + 6 = 9 tokens
    # the verifier accepted 4 and 5, then sampled 20 where the draft said 6
    sched.update_from_output(batch, StepResult([4], [0], None, {}, more={0: [5, 20]}))
    assert a.token_ids == [1, 2, 3, 9, 4, 5, 20]
    assert a.num_computed_tokens == 6  # 3 + the last token and the two accepted drafts
    assert len(kv.block_table(0)) == 2  # 7 tokens: the third block held only rejected drafts
    assert a.draft_token_ids == [4, 5, 6, 7, 8]  # held until replaced: update_draft_token_ids after each step
    sched.update_draft_token_ids({})
    assert a.draft_token_ids == []


def test_a_stop_token_among_accepted_drafts_ends_the_request_there():
    kv = PagedKVCacheManager(32, 4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    a = _seq(0, [1, 2, 3], max_tokens=50, stop_token_ids=[5])
    _prefill(sched, a)
    sched.update_draft_token_ids({0: [4, 5, 6]})
    batch = sched.schedule()
    sched.update_from_output(batch, StepResult([4], [0], None, {}, more={0: [5, 6, 30]}))
    assert (a.output_token_ids, a.finish_reason, a.stop_reason) == ([9, 4, 5], "stop", 5)
    assert kv.num_free_blocks == 32


def test_forks_of_an_n_request_are_queued_once_the_prompt_is_computed():
    kv = PagedKVCacheManager(32, 4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=4, max_model_len=64)
    head, fork = _seq(0, list(range(1, 7))), _seq(1, list(range(1, 7)))
    sched.add(head, [fork])
    first = sched.schedule()  # 4 of 6 prompt tokens: no token sampled, the fork waits
    sched.update_from_output(first, StepResult([], [], None, {}))
    assert list(sched.waiting) == []
    second = sched.schedule()
    sched.update_from_output(second, StepResult([9], [0], None, {}))
    assert list(sched.waiting) == [fork]


def test_a_stop_string_inside_accepted_tokens_is_found_at_its_token():
    class Chars:  # token t is the character chr(t)
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    seq = _seq(0, [65], stop=["cd"], max_tokens=50)
    seq.token_ids += [ord(ch) for ch in "abcde"]  # the step brought "b", "c", "d", "e"
    hits = OutputProcessor(Chars()).stop_strings([seq], {0: 4})
    assert hits == [(seq, "cd", 1 + 4)]  # keep the prompt and "abcd": "e" came after the stop string
