"""Several callers on one ``LLM``: threads, interleaved iterators, aborts from anywhere, teardown.

Every caller's requests join one engine loop and each caller gets exactly its own outputs, equal to
the same requests run alone (greedy on the reference ``torch`` backend is batch-independent on CPU).
An abort from any thread, whatever state the request is in, ends that request as ``abort`` and
nothing else. ``del llm`` / ``llm.shutdown()`` frees the engine at once (no garbage collection
needed), with no thread left holding it.
"""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from corerun import SamplingParams
from corerun.engine.loop import EngineLoop
from corerun.errors import EngineClosedError, RequestError
from corerun.testing import assert_idle, make_llm
from tests.helpers.engine_testing import no_hang  # noqa: F401 (no_hang: a fixture)
from tests.helpers.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("reliability-concurrency"), arch="llama")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (24,), generator=g)]


SCHEDULER: dict[str, Any] = {}  # every engine's scheduler= here (the fixture below sets async_scheduling)


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "async"])
def async_scheduling(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Every test runs with synchronous and with asynchronous scheduling (docs/usage.md)."""
    monkeypatch.setitem(SCHEDULER, "async_scheduling", request.param)
    return request.param


@pytest.fixture(scope="module")
def solo(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens, run one at a time in a roomy engine."""
    llm = make_llm(model_dir, kv_cache={"num_blocks": 256})
    return [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]


def tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_generate_from_several_threads_gets_each_its_own_outputs(model_dir, prompts, solo) -> None:
    llm = make_llm(model_dir, kv_cache={"num_blocks": 24}, scheduler={**SCHEDULER, "max_num_seqs": 8})  # small: preemption across the callers' requests
    results: dict[int, Any] = {}

    def caller(k: int) -> None:
        try:
            mine = [(k + 5 * j) % len(prompts) for j in range(12)]
            for _ in range(2):
                outs = llm.generate([prompts[i] for i in mine], GREEDY, use_tqdm=False)
                assert tokens(outs) == [solo[i] for i in mine]
                assert all(o.outputs[0].finish_reason == "length" for o in outs)
            results[k] = True
        except BaseException as exc:  # noqa: BLE001 (reported below)
            results[k] = exc

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {k: True for k in range(4)}
    assert llm.engine.scheduler.num_preemptions > 0
    assert_idle(llm)


def test_paused_stream_loses_nothing_while_generate_runs(model_dir, prompts, solo) -> None:
    llm = make_llm(model_dir, scheduler=SCHEDULER)
    stream = llm.stream(prompts[0], GREEDY)
    first = next(stream)
    assert first.outputs[0].token_ids == solo[0][:1]
    # the stream is paused; generate drives the shared loop to completion meanwhile
    assert tokens(llm.generate(prompts[1:4], GREEDY)) == solo[1:4]
    rest = list(stream)
    assert [len(o.outputs[0].token_ids) for o in rest] == list(range(2, 11))
    assert rest[-1].finished and rest[-1].outputs[0].token_ids == solo[0]
    assert_idle(llm)


def test_two_streams_consumed_with_zip_both_finish(model_dir, prompts, solo) -> None:
    llm = make_llm(model_dir, scheduler=SCHEDULER)
    a = llm.stream(prompts[5], GREEDY)
    b = llm.stream(prompts[6], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    pairs = list(zip(a, b))  # b ends first; zip then drops a's next output: a is left paused, not lost
    assert pairs[-1][1].finished and pairs[-1][1].outputs[0].token_ids == solo[6][:4]
    rest = list(a)
    assert rest[-1].finished and rest[-1].outputs[0].token_ids == solo[5]
    assert_idle(llm)


def test_abort_of_a_waiting_request_ends_it_alone(model_dir, prompts, solo) -> None:
    llm = make_llm(model_dir, scheduler={**SCHEDULER, "max_num_seqs": 1})  # one at a time: the others wait
    engine = llm.engine
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)  # keeps the others waiting a while
    stream = llm.stream(prompts[:4], [long, GREEDY, GREEDY, GREEDY])
    first = next(stream)
    with engine.lock:  # the loop thread is between steps
        waiting = [s.request_id for s in engine.scheduler.waiting]
        assert len(waiting) == 3 and first.request_id not in waiting
        engine.abort(waiting[0])  # the engine's own abort, behind the loop's back
    llm.abort(waiting[1])  # and the front's, from this thread while the loop runs
    llm.abort("no-such-request")  # ignored
    by_id = {out.request_id: out for out in [first, *stream]}
    reasons = {rid: o.outputs[0].finish_reason for rid, o in by_id.items()}
    assert reasons == {first.request_id: "length", waiting[0]: "abort", waiting[1]: "abort", waiting[2]: "length"}
    assert by_id[waiting[0]].outputs[0].token_ids == by_id[waiting[1]].outputs[0].token_ids == []
    assert by_id[first.request_id].outputs[0].token_ids[:10] == solo[0]
    assert by_id[waiting[2]].outputs[0].token_ids == solo[3]
    assert_idle(llm)


def test_abort_from_another_thread_during_steps_is_an_abort(model_dir, prompts, solo) -> None:
    llm = make_llm(model_dir, scheduler={**SCHEDULER, "max_num_seqs": 4})
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    ids: list[str] = []
    seen = threading.Event()

    def aborter() -> None:
        seen.wait()
        llm.abort(ids[0])

    t = threading.Thread(target=aborter)
    t.start()
    outs = {}
    for out in llm.stream([prompts[7], prompts[8]], [long, GREEDY]):
        if not ids and out.prompt_token_ids == prompts[7]:
            ids.append(out.request_id)
        if out.prompt_token_ids == prompts[7] and len(out.outputs[0].token_ids) == 3:
            seen.set()
        outs[out.prompt_token_ids == prompts[7]] = out
    t.join()
    aborted, other = outs[True].outputs[0], outs[False].outputs[0]
    assert aborted.finish_reason == "abort" and aborted.error is None and 3 <= len(aborted.token_ids) < 100
    assert aborted.token_ids[:10] == solo[7][:len(aborted.token_ids)]  # greedy: its first 10 are solo's
    assert other.finish_reason == "length" and other.token_ids == solo[8]
    llm.abort(outs[False].request_id)  # finished: left as it finished
    assert_idle(llm)


def test_interrupted_generate_aborts_its_own_requests_only(model_dir, prompts, solo) -> None:
    llm = make_llm(model_dir, scheduler=SCHEDULER)
    other = llm.stream(prompts[9], GREEDY)
    next(other)

    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    import signal

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts * 20, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    rest = list(other)  # the other caller's request is untouched
    assert rest[-1].outputs[0].finish_reason == "length" and rest[-1].outputs[0].token_ids == solo[9]
    assert_idle(llm)


def test_generate_interrupted_while_its_requests_are_admitted_leaves_none_running(model_dir, prompts) -> None:
    """Ctrl-C while the loop is still admitting the batch (before generate knows the ids): the
    requests are aborted once admitted, not left running unread."""
    llm = make_llm(model_dir, scheduler=SCHEDULER)
    loop = llm.engine_loop
    admit, entered, go = loop._admit, threading.Event(), threading.Event()

    def slow_admit(*args: Any) -> Any:
        entered.set()
        go.wait()
        return admit(*args)

    loop._admit = slow_admit  # type: ignore[method-assign]
    import signal

    def interrupt(*_: Any) -> None:
        go.set()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert entered.is_set()
    del loop._admit
    llm.generate(prompts[0], GREEDY)  # the abort was queued before this: it has been applied
    assert_idle(llm)


def test_one_bad_request_in_a_batch_refuses_the_batch_and_spares_other_callers(model_dir, prompts, solo) -> None:
    llm = make_llm(model_dir, scheduler=SCHEDULER)
    running = llm.stream(prompts[10], GREEDY)
    next(running)
    with pytest.raises(RequestError, match="prompt 1: prompt token 0 is 999"):
        llm.generate([prompts[0], [999]], GREEDY)
    assert list(running)[-1].outputs[0].token_ids == solo[10]
    assert_idle(llm)


def test_loop_front_for_a_server(model_dir, prompts, solo) -> None:
    """``EngineLoop.add_request`` streams (sync and asyncio), request ids, abort through the stream, shutdown."""
    import asyncio

    llm = make_llm(model_dir, scheduler=SCHEDULER)
    loop: EngineLoop = llm.engine_loop
    s = loop.add_request(prompts[11], GREEDY, request_id="mine")
    assert s.request_id == "mine"
    with pytest.raises(RequestError, match="already in use"):
        loop.add_request(prompts[12], GREEDY, request_id="mine")
    assert [o.outputs[0].token_ids for o in s][-1] == solo[11]

    async def main() -> tuple[list[int], str]:
        a = await loop.add_request_async(prompts[12], GREEDY)
        b = await loop.add_request_async(prompts[13], SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
        last_b = None
        async for out in b:
            last_b = out
            if len(out.outputs[0].token_ids) == 2:
                b.abort(wait=False)  # as a server does when its client goes away
        last_a = [o async for o in a][-1]
        return last_a.outputs[0].token_ids, last_b.outputs[0].finish_reason

    got, reason = asyncio.run(main())
    assert got == solo[12] and reason == "abort"
    assert_idle(llm)
    hanging = llm.stream(prompts[14], GREEDY)
    next(hanging)
    llm.shutdown()
    assert list(hanging)[-1].outputs[0].finish_reason == "abort"
    assert llm.engine.kv.num_free_blocks == llm.engine.runner.num_blocks
    with pytest.raises(EngineClosedError):
        llm.generate(prompts[0], GREEDY)
    llm.shutdown()  # twice is harmless


@pytest.mark.parametrize("how", ["del", "shutdown"])
def test_teardown_frees_the_engine_at_once(model_dir, prompts, how: str) -> None:
    llm = make_llm(model_dir, scheduler=SCHEDULER)
    llm.generate(prompts[:3], GREEDY)  # the loop thread ran
    s = llm.stream(prompts[0], GREEDY)
    next(s)
    s.close()
    runner = llm.engine.runner
    memory = [weakref.ref(runner.graph)] + [weakref.ref(t) for t in runner.kv_caches]
    assert len(memory) > 1
    engine = [weakref.ref(llm.engine), weakref.ref(runner)]
    del runner, s
    gc.disable()  # freed by reference counting alone, not by a later collection
    try:
        if how == "shutdown":
            llm.shutdown()  # frees the KV cache and graphs though the LLM object lives on
            alive = [type(r()).__name__ for r in memory if r() is not None]
            assert not alive, f"still alive after shutdown(): {alive}"
            with pytest.raises(EngineClosedError):
                llm.engine.step()
        del llm
        alive = [type(r()).__name__ for r in memory + engine if r() is not None]
        assert not alive, f"still alive after {how}: {alive}"
    finally:
        gc.enable()
    assert not [t for t in threading.enumerate() if t.name == "corerun-engine"]


def test_a_failing_loop_fails_its_callers_and_recovers(model_dir, prompts, solo, monkeypatch) -> None:
    """A bug in the loop (here: building outputs raises outside any plugin) reaches the callers as an
    error instead of leaving them waiting; the next call starts a fresh loop."""
    llm = make_llm(model_dir, scheduler=SCHEDULER)
    loop = llm.engine_loop

    def broken(*_: Any) -> None:
        raise RuntimeError("bug in the loop")

    monkeypatch.setattr(loop, "_collect_outside_aborts", broken)
    with pytest.raises(Exception, match="the engine loop failed: RuntimeError: bug in the loop"):
        llm.generate(prompts[:3], GREEDY)
    monkeypatch.undo()
    assert tokens(llm.generate(prompts[:3], GREEDY)) == solo[:3]
    assert_idle(llm)
