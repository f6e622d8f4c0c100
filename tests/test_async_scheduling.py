"""``scheduler.async_scheduling``: step N+1 scheduled while step N runs, outputs identical to synchronous.

Each scenario runs the same requests through an engine with asynchronous scheduling and one without
and compares them token for token (and logprob for logprob): greedy with preemption, chunked
prefill and prefix caching (also against Hugging Face transformers), seeded sampling with
penalties, logprobs, prompt logprobs, stop tokens and ``min_tokens``, ``n > 1``, stop strings,
structured output, the reliability soak's mixed workload, streaming and aborts; and the built-in
default model against transformers. A request never gets a token past its end (``max_tokens``, a stop token, a
stop string, an abort), every block comes back, and the overlap itself is checked: the next step is
scheduled while the sampler of the current one is still running.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from corerun import LLM, SamplingParams
from corerun.errors import ConfigError
from corerun.testing import assert_idle, make_llm
from tests.helpers.engine_testing import no_hang  # noqa: F401 (no_hang: a fixture)
from tests.helpers.serving import tiny_chat_model
from tests.helpers.tiny_models import make_tiny_model
# the model, ten prompts (1 to 14 tokens, three sharing a prefix) and their transformers greedy references
from tests.test_reliability_exhaustion import MAX_TOKENS, _same_logprobs, tiny  # noqa: F401 (tiny: a fixture)

PROMPT = "the cat sat on the mat and the dog sat on the log"


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("async-chat"))


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[Any]:
    """``pair(model_dir, num_blocks, **scheduler)`` -> (synchronous LLM, asynchronous LLM); shut down afterwards."""
    made: list[LLM] = []

    def build(model_dir: Path, num_blocks: int, **scheduler: Any) -> tuple[LLM, LLM]:
        made.extend(make_llm(model_dir, kv_cache={"num_blocks": num_blocks}, scheduler={**scheduler, "async_scheduling": on})
                    for on in (False, True))
        return made[-2], made[-1]

    yield build
    for llm in made:
        llm.shutdown()


def completions(outs: list) -> list[tuple]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]


# ------------------------------------------------------------- equivalence
@pytest.mark.parametrize(
    "scheduler",
    [pytest.param({}, id="whole-prefill"), pytest.param({"max_num_batched_tokens": 6}, id="chunked"),
     pytest.param({"chunked_prefill": False}, id="no-chunking")],
)
def test_greedy_with_preemption_equals_sync_and_transformers(tiny, pair, scheduler: dict) -> None:
    """7 blocks (28 slots) for ten requests of up to 23 tokens of K/V each: preemption, prefix hits."""
    model_dir, prompts, expected = tiny
    sync, asyn = pair(model_dir, 7, **scheduler)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for run in range(2):  # the second run starts with prefixes cached by the first
        a, s = asyn.generate(prompts, greedy, use_tqdm=False), sync.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in a] == expected, f"run {run}"
        assert completions(a) == completions(s)
        assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == MAX_TOKENS for o in a)
        assert_idle(asyn)
    assert asyn.engine.scheduler.num_preemptions > 3
    assert asyn.engine.kv.stats().prefix_hits > 0


def test_seeded_sampling_logprobs_penalties_and_stop_tokens_equal_sync(tiny, pair) -> None:
    model_dir, prompts, _ = tiny
    params = [
        SamplingParams(temperature=0.8, seed=1, max_tokens=MAX_TOKENS, logprobs=3),
        SamplingParams(temperature=1.2, top_k=20, seed=2, max_tokens=MAX_TOKENS, prompt_logprobs=2),
        SamplingParams(temperature=0.7, top_p=0.9, min_p=0.02, seed=3, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, seed=4,
                       max_tokens=MAX_TOKENS),
        SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=MAX_TOKENS, logprobs=1, prompt_logprobs=0),
        SamplingParams(temperature=0.9, seed=5, min_tokens=4, max_tokens=MAX_TOKENS, stop_token_ids=[7, 9]),
        SamplingParams(temperature=1.0, seed=6, max_tokens=1),
        SamplingParams(temperature=1.5, seed=8, max_tokens=MAX_TOKENS, stop_token_ids=list(range(3, 200))),
    ] * 2
    prompts = (prompts * 2)[: len(params)]
    sync, asyn = pair(model_dir, 7, max_num_batched_tokens=6)
    a, s = asyn.generate(prompts, params, use_tqdm=False), sync.generate(prompts, params, use_tqdm=False)
    assert asyn.engine.scheduler.num_preemptions > 0
    assert completions(a) == completions(s)
    for x, y, p in zip(a, s, params):
        _same_logprobs(x.outputs[0].logprobs, y.outputs[0].logprobs)
        _same_logprobs(x.prompt_logprobs, y.prompt_logprobs)
        c = x.outputs[0]
        assert len(c.token_ids) <= p.max_tokens
        if c.finish_reason == "stop":  # ended on its stop token (or end of sequence): nothing after it
            assert c.token_ids[-1] in {*p.stop_token_ids, *asyn.engine.eos_token_ids}
            assert c.stop_reason in (None, c.token_ids[-1])
    assert any(o.outputs[0].finish_reason == "stop" for o in a)  # the stop tokens were hit
    assert_idle(asyn)


def test_n_samples_and_stop_strings_equal_sync(chat, pair) -> None:
    sync, asyn = pair(chat, 96)
    full = sync.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    text = full[0].outputs[0].text
    stop = text[len(text) // 3: len(text) // 3 + 2]  # a stop string the greedy continuation reaches
    params = [
        SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True, logprobs=1, prompt_logprobs=0),
        SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=30, ignore_eos=True, stop=["e"]),
    ]
    prompts = [PROMPT, PROMPT, PROMPT, PROMPT, "the dog"]
    a, s = asyn.generate(prompts, params, use_tqdm=False), sync.generate(prompts, params, use_tqdm=False)
    assert completions(a) == completions(s)
    for x, y in zip(a, s):
        for cx, cy in zip(x.outputs, y.outputs):
            _same_logprobs(cx.logprobs, cy.logprobs)
    assert a[2].outputs[0].finish_reason == "stop" and a[2].outputs[0].stop_reason == stop
    assert a[2].outputs[0].text == text[: text.index(stop)]
    assert_idle(asyn)


def test_structured_output_equals_sync(chat, pair) -> None:
    """Logits processors (xgrammar) end requests when their grammar completes: the same texts and the
    same ends asynchronously, and every processor state freed."""
    pytest.importorskip("xgrammar")
    sync, asyn = pair(chat, 96)
    choices = ["yes", "no", "maybe later"]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, structured_outputs={"choice": choices}) for s in range(4)]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=24, structured_outputs={"regex": r"(ab|cd)+e"}) for s in range(4)]
    params += [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 2  # unconstrained rows beside them
    prompts = ["Answer:"] * 4 + ["Word:"] * 4 + [PROMPT] * 2
    a, s = asyn.generate(prompts, params, use_tqdm=False), sync.generate(prompts, params, use_tqdm=False)
    assert completions(a) == completions(s)
    assert all(o.outputs[0].text in choices for o in a[:4])
    assert [o.outputs[0].finish_reason for o in a[:8]] == ["stop"] * 8
    assert asyn.engine.runner.logits_processors.num_requests == 0
    assert_idle(asyn)


# ------------------------------------------------------ ends are never overrun
def test_streams_never_show_a_token_past_the_end(chat, pair) -> None:
    """Streamed outputs are prefixes of the final one, which equals the synchronous engine's; the
    request that stops (stop string) or runs out (max_tokens) gets no token after its end."""
    sync, asyn = pair(chat, 96)
    full = sync.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    stop_token = full.outputs[0].token_ids[5]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_token]),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[full.outputs[0].text[8:10]])]
    for p in params:
        ref = sync.generate([PROMPT], p, use_tqdm=False)[0].outputs[0]
        outs = list(asyn.stream([PROMPT], p))
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        final = outs[-1].outputs[0]
        assert (final.token_ids, final.text, final.finish_reason, final.stop_reason) == (
            ref.token_ids, ref.text, ref.finish_reason, ref.stop_reason)
        for o in outs:
            got = o.outputs[0]
            assert got.token_ids == final.token_ids[: len(got.token_ids)] and final.text.startswith(got.text)
        assert len(final.token_ids) <= p.max_tokens
        assert_idle(asyn)
    assert final.finish_reason == "stop"


def test_abort_mid_generation_frees_at_once_and_spares_the_others(chat, pair) -> None:
    sync, asyn = pair(chat, 96)
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = sync.generate(["the dog"], p, use_tqdm=False)[0].outputs[0].token_ids
    engine = asyn.engine
    for at in (1, 2, 5):
        long = asyn.stream([PROMPT], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
        other = asyn.stream(["the dog"], p)
        seen = [next(long) for _ in range(at)]
        long.close()  # abort while a step is in flight
        assert seen[-1].outputs[0].token_ids[: len(seen[0].outputs[0].token_ids)] == seen[0].outputs[0].token_ids
        outs = list(other)
        assert outs[-1].outputs[0].token_ids == ref
        assert_idle(asyn)
    # straight on the engine: abort between two steps while one is in flight
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
    keep = engine.add_request("the dog", p)
    for _ in range(4):
        engine.step()
    assert engine.queue.in_flight is not None
    aborted = engine.requests[rid]
    n = aborted.num_output_tokens
    engine.abort(rid)
    assert engine.queue.in_flight is None and aborted.finish_reason == "abort" and aborted.num_output_tokens >= n
    done: list = []
    while engine.has_unfinished_requests():
        touched = engine.step()
        assert aborted not in touched  # a step never returns an aborted request
        done += [s for s in touched if s.is_finished]
    assert [s.request_id for s in done] == [keep] and done[0].output_token_ids == ref
    engine.release(rid)
    engine.release(keep)
    assert_idle(asyn)


def test_requests_at_max_model_len(tiny, pair) -> None:
    """A request stopped by max_model_len gets exactly the tokens the synchronous engine gives it."""
    model_dir, prompts, _ = tiny
    sync, asyn = pair(model_dir, 64, max_model_len=20)
    long = [p * 3 for p in prompts][:6]
    long = [p[:18] for p in long]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    a, s = asyn.generate(long, sp, use_tqdm=False), sync.generate(long, sp, use_tqdm=False)
    assert completions(a) == completions(s)
    assert all(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) <= 20 for o in a)
    assert_idle(asyn)


# ------------------------------------------------------------- the overlap
def test_the_next_step_is_scheduled_while_the_current_one_samples(tiny) -> None:
    """Each step's sampler waits until the scheduler is called again after that step was prepared:
    only an engine that schedules step N+1 while step N runs gets through (a synchronous one, which
    schedules again only after sampling, would time out)."""
    model_dir, prompts, expected = tiny
    llm = make_llm(model_dir, scheduler={"async_scheduling": True})
    engine = llm.engine
    cv = threading.Condition()
    calls = [0]  # scheduler calls so far
    at_launch: dict[int, int] = {}  # id(prepared step) -> scheduler calls when it was prepared
    threads: set[str] = set()
    waits: list[bool] = []
    schedule, prepare, sample_tokens = engine.scheduler.schedule, engine.runner.prepare_step, engine.runner.sample_tokens

    def counting_schedule() -> Any:
        with cv:
            calls[0] += 1
            cv.notify_all()
        return schedule()

    def noting_prepare(sched: Any, eos: Any) -> Any:
        step = prepare(sched, eos)
        at_launch[id(step)] = calls[0]
        return step

    def waiting_sample(state: Any) -> Any:
        threads.add(threading.current_thread().name)
        seen = at_launch[id(state.step)]
        with cv:
            waits.append(cv.wait_for(lambda: calls[0] > seen, timeout=10))
        return sample_tokens(state)

    engine.scheduler.schedule = counting_schedule  # type: ignore[method-assign]
    engine.runner.prepare_step = noting_prepare  # type: ignore[method-assign]
    engine.runner.sample_tokens = waiting_sample  # type: ignore[method-assign]
    try:
        outs = llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected[:3]
    assert len(waits) >= MAX_TOKENS and all(waits)
    assert threading.current_thread().name not in threads and len(threads) == 1


# ------------------------------------------------------------ configuration
def test_async_scheduling_is_off_by_default_and_refused_where_unsupported(tiny) -> None:
    from corerun.config import Config

    assert Config().scheduler.async_scheduling is False
    model_dir = tiny[0]
    with pytest.raises(ConfigError, match=r"scheduler.async_scheduling.*tensor_parallel_size is 2"):
        make_llm(model_dir, scheduler={"async_scheduling": True}, tensor_parallel_size=2)
    with pytest.raises(Exception, match="async_scheduling"):
        Config(scheduler={"async_scheduling": "sometimes"})
    with make_llm(model_dir, speculative={"method": "ngram"}) as spec:  # with speculation (tests/test_async_spec.py)
        spec.engine.set_async_scheduling(True)
        assert spec.engine.async_scheduling is True
        spec.engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
        with pytest.raises(RuntimeError, match="no request is running"):
            spec.engine.set_async_scheduling(False)


def test_batches_tell_the_runner_every_block_table_change(tiny) -> None:
    """Protocol version 3 under asynchronous scheduling: replaying the launched batches (requests that
    left, new ones' whole tables, the others' block-table changes) gives each scheduled request's table
    as the KV-cache manager has it, although requests that ended in the step in flight are dropped from
    the next batch before its launch."""
    from corerun.core.scheduler import ScheduledBatch

    model_dir, prompts, _ = tiny
    llm = make_llm(model_dir, kv_cache={"num_blocks": 9}, scheduler={"async_scheduling": True, "max_num_batched_tokens": 6})
    engine = llm.engine
    tables: dict[int, list[int]] = {}
    finished: set[int] = set()
    checked = [0]
    prepare = engine.runner.prepare_step

    def replaying_prepare(sched: Any, eos: Any) -> Any:
        for sid in sched.finished_ids | sched.preempted_ids:
            tables.pop(sid, None)
        finished.update(sched.finished_ids)
        for r in sched.new_reqs:
            tables[r.seq_id] = list(r.block_ids)
        for sid, change in sched.block_changes.items():
            tables[sid] = change.apply(tables[sid])
        for sid, s in zip(sched.req_ids, engine.scheduler.seqs_of(sched)):
            assert sid not in finished and s is not None and not s.is_finished
            assert tables[sid] == list(engine.kv.block_table(sid))
            checked[0] += 1
        return prepare(sched, eos)

    engine.runner.prepare_step = replaying_prepare  # type: ignore[method-assign]
    dropped = [0]
    only = ScheduledBatch.only

    def counting_only(sched: Any, keep: list[int]) -> Any:
        dropped[0] += len(sched.req_ids) - len(keep)
        return only(sched, keep)

    # random stop tokens end requests at steps the scheduler cannot foresee: they are dropped before launch
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=1 + i % 9, stop_token_ids=list(range(3, 60)))
              for i in range(2 * len(prompts))]
    ScheduledBatch.only = counting_only  # type: ignore[method-assign]
    try:
        outs = llm.generate(prompts * 2, params, use_tqdm=False)
    finally:
        ScheduledBatch.only = only  # type: ignore[method-assign]
        llm.shutdown()
    assert all(len(o.outputs[0].token_ids) <= p.max_tokens for o, p in zip(outs, params))
    assert engine.scheduler.num_preemptions > 0 and checked[0] > 30 and dropped[0] > 0


def test_the_step_thread_runs_on_the_engine_threads_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``device: cuda`` has no index: the step thread is put on the device current on the engine's thread
    (``torch.cuda.set_device`` refuses an index-less device), and nothing is set off CUDA."""
    import torch

    from corerun.engine import batch_queue

    calls: list[Any] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    assert batch_queue._cuda_index(torch.device("cuda")) == 3
    assert batch_queue._cuda_index(torch.device("cuda", 1)) == 1
    assert batch_queue._cuda_index(torch.device("cpu")) is None
    threads = torch.get_num_threads()
    batch_queue._init_step_thread(batch_queue._cuda_index(torch.device("cuda")), threads)
    batch_queue._init_step_thread(None, threads)
    assert calls == [3]


def test_soak_workload_equals_sync(pair, tmp_path: Path) -> None:
    """The reliability soak's mixed workload (greedy, seeded and unseeded sampling, penalties, min_tokens,
    stop ids, logit-bias bans, logprobs; 64 at a time in a cache that holds far fewer): every request
    ends as its parameters say, and each deterministic one gets the synchronous engine's tokens."""
    from tests.test_reliability_soak import NUM_BLOCKS, check_finished_as_asked, run, workload

    requests = workload(300, seed=31)
    sync, asyn = pair(make_tiny_model(tmp_path, arch="llama"), NUM_BLOCKS, max_num_seqs=64, max_num_batched_tokens=128)
    a, s = run(asyn, requests), run(sync, requests)
    eos = asyn.engine.eos_token_ids
    compared = 0
    for req, x, y in zip(requests, a, s):
        check_finished_as_asked(req, x, eos)
        if req.deterministic:
            cx, cy = x.outputs[0], y.outputs[0]
            assert (cx.token_ids, cx.finish_reason, cx.stop_reason) == (cy.token_ids, cy.finish_reason, cy.stop_reason), req
            _same_logprobs(cx.logprobs, cy.logprobs)
            compared += 1
    assert compared > 250 and asyn.engine.scheduler.num_preemptions > 0


def test_default_model_equals_transformers() -> None:
    """The built-in default model (SmolLM2-135M, float32) with asynchronous scheduling: greedy tokens
    equal Hugging Face transformers' (converted once into the user's cache, as test_default_model does)."""
    from corerun.models import default_model_dir
    from corerun.testing import hf_greedy

    with LLM(scheduler={"async_scheduling": True}, device="cpu", dtype="float32", threads=1) as llm:
        tok = llm.get_tokenizer()
        prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):", "Once upon a time")]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
        assert_idle(llm)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(default_model_dir(progress=False), prompts, 10)
