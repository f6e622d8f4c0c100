"""Data-parallel serving: two engine replicas, each in its own process, behind one API server.

The router is checked against hand-computed choices; the served replicas against one in-process engine
(greedy outputs equal), under a bounded version of the server load test (no leaks in either replica,
``/metrics`` per replica summing to the whole), and with one replica killed mid-load: only the requests
it held fail, each with an error naming it, and the other replica keeps serving.  The last test kills a
replica, so it stays last.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from corerun.config import load_config  # noqa: E402
from corerun.server.data_parallel.router import Router  # noqa: E402
from corerun.testing import TEST_DEFAULTS, leftovers, make_llm  # noqa: E402
from tests.helpers.engine_testing import no_hang  # noqa: E402,F401
from tests.helpers.serving import SERVING, http, metric, server_and_url, tiny_chat_model  # noqa: E402
from tests.test_server_load import WORDS, plan_load, run_load  # noqa: E402

CLIENTS, REQUESTS = 12, 4


# ------------------------------------------------------------------ the router
def test_router_takes_the_least_busy_unless_a_prefix_lives_elsewhere() -> None:
    r = Router(block_size=4, slack_tokens=100)
    assert r.choose([1, 2, 3], [100, 40]) == 1  # shorter than a block: least outstanding tokens
    assert r.choose([1, 2, 3], [7, 7]) == 0  # a tie: the lowest index
    shared = [5, 6, 7, 8, 9, 10, 11, 12]  # two blocks
    assert r.choose(shared + [1], [30, 10]) == 1  # first seen: the least busy, and remembered
    assert r.choose(shared + [2], [10, 50]) == 1  # 50 <= 2 * 10 + 100: affinity wins
    assert r.choose(shared[:4] + [0, 0, 0, 0], [10, 60]) == 1  # the first block alone still points there
    assert r.choose(shared + [3], [10, 121]) == 0  # 121 > 2 * 10 + 100: much busier, so the least busy
    assert r.choose(shared + [4], [200, 121]) == 0  # the prefix lives on replica 0 now (200 <= 2 * 121 + 100)
    assert r.choose(shared, [None, 5]) == 1  # a replica that is not serving is never chosen
    with pytest.raises(LookupError):
        r.choose(shared, [None, None])


def test_data_parallel_refuses_what_replicas_cannot_serve() -> None:
    from corerun.errors import ConfigError
    from corerun.server.data_parallel.front import DataParallelEngine

    for extra, field in (({"distributed": {"init_method": "tcp://10.0.0.1:29500"}}, "distributed.init_method"),
                         ({"lora": {"enabled": True}}, "lora.enabled")):
        config = load_config(None, overrides={**TEST_DEFAULTS, "server": {"data_parallel_size": 2}, **extra})
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            DataParallelEngine(config)  # refused before any process starts


# ------------------------------------------------------------------ two replicas
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_chat_model(tmp_path_factory.mktemp("dp"))


ENGINE = dict(**SERVING, kv_cache={"block_size": 4, "num_blocks": 256})


@pytest.fixture(scope="module")
def served(model_dir: Any) -> Iterator[tuple[Any, str]]:
    from corerun.server.data_parallel.front import DataParallelEngine

    overrides = {**TEST_DEFAULTS, **ENGINE, "model": str(model_dir), "server": {"data_parallel_size": 2},
                 "distributed": {"start_method": "forkserver"}}  # (corerun and torch imported once for both)
    front = DataParallelEngine(load_config(None, overrides=overrides))
    try:
        with server_and_url(front) as (_, url):
            yield front, url
    finally:
        front.shutdown()


def _tree(pids: list[int]) -> list[int]:
    """``pids`` and every process below them (read from /proc)."""
    parent = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += [c for c, p in parent.items() if p == pid]
    return found


def _left(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """Those of ``pids`` still in the process table after ``grace_s`` (a zombie too: nobody reaped it)."""
    end = time.monotonic() + grace_s
    while (left := [p for p in pids if os.path.exists(f"/proc/{p}")]) and time.monotonic() < end:
        time.sleep(0.05)
    return left


def _idle(front: Any, timeout: float = 30.0) -> None:
    """Every serving replica holds nothing (corerun.testing.leftovers, run in the replica)."""
    end = time.monotonic() + timeout
    for r in front.replicas:
        if not r.serving:
            continue
        while (left := r.call(leftovers)) and time.monotonic() < end:
            time.sleep(0.05)
        assert left == [], f"replica {r.index}: {left}"


@pytest.mark.timeout(240)
def test_greedy_outputs_equal_one_engine_and_shared_prefixes_stay_together(served: tuple[Any, str],
                                                                            model_dir: Any) -> None:
    front, url = served
    rng = random.Random(1)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(6)]
    got = []
    for p in prompts:
        status, body = http(url + "/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0.0})
        assert status == 200, body
        got.append(body["choices"][0]["text"])
    tok = front.get_tokenizer()
    ids = [tok.encode(p) for p in prompts[:2]]
    status, body = http(url + "/v1/embeddings", {"input": ids})
    assert status == 200, body
    with make_llm(model_dir, **ENGINE) as ref:
        want = [o.outputs[0].text for o in ref.generate(prompts, {"max_tokens": 8, "temperature": 0.0})]
        vectors = [o.outputs.embedding for o in ref.embed(ids)]
    assert got == want
    for d, v in zip(body["data"], vectors, strict=True):  # embedding requests through a replica too
        assert d["embedding"] == pytest.approx(v, abs=1e-6)

    before = http(url + "/metrics")[1]
    system = "the cat sat on a mat and then the dog ran off to see what it had " * 2  # several blocks
    for i in range(4):
        status, _ = http(url + "/v1/completions", {"prompt": system + WORDS[i], "max_tokens": 2})
        assert status == 200
    after = http(url + "/metrics")[1]
    per = [metric(after, "vllm:request_success_total", engine=e) - metric(before, "vllm:request_success_total", engine=e)
           for e in ("0", "1")]
    assert sorted(per) == [0, 4], per  # one replica took all four: their prefix is cached there
    hits = [metric(after, "vllm:prefix_cache_hits_total", engine=e) - metric(before, "vllm:prefix_cache_hits_total", engine=e)
            for e in ("0", "1")]
    assert hits[per.index(4)] > 0


@pytest.mark.timeout(300)
def test_two_replicas_pass_the_load_test(served: tuple[Any, str]) -> None:
    front, url = served
    tok = front.get_tokenizer()
    plan = plan_load(CLIENTS, REQUESTS)
    before = http(url + "/metrics")[1]
    complete, hung, _ = run_load(url, plan, tok)
    assert complete + hung == CLIENTS * REQUESTS and hung > 0
    _idle(front)  # every request over, every block back, in both replicas
    after = http(url + "/metrics")[1]

    def delta(name: str, engine: str, **labels: str) -> float:
        return metric(after, name, engine=engine, **labels) - metric(before, name, engine=engine, **labels)

    sent = sum(len(tok.encode(p)) for _, p, _, _ in plan)
    assert delta("vllm:prompt_tokens_total", "all") == sent
    assert delta("vllm:prompt_tokens_total", "0") + delta("vllm:prompt_tokens_total", "1") == sent
    assert delta("vllm:request_success_total", "all") == CLIENTS * REQUESTS
    per = [delta("vllm:request_success_total", e) for e in ("0", "1")]
    assert sum(per) == CLIENTS * REQUESTS and min(per) > 0, per  # both replicas served
    assert delta("vllm:request_success_total", "all", finished_reason="abort") <= hung
    for e in ("0", "1", "all"):
        assert metric(after, "vllm:num_requests_running", engine=e) == metric(after, "vllm:num_requests_waiting", engine=e) == 0
        assert metric(after, "vllm:kv_cache_usage_perc", engine=e) == 0


@pytest.mark.timeout(300)
def test_a_killed_replica_fails_only_its_requests(served: tuple[Any, str]) -> None:  # (last: it kills replica 1)
    front, url = served
    victim, survivor = front.replicas[1], front.replicas[0]
    processes = _tree([r.pid for r in front.replicas])
    max_tokens, count = 100, 12
    snapshot: dict[str, set[str]] = {}

    async def one(client: Any, i: int) -> tuple[str, list[str]]:
        lines: list[str] = []
        rid = ""
        async with client.completions.with_streaming_response.create(
            model="tiny-llama", prompt=f"{WORDS[i]} {WORDS[-i - 1]} and {i}", max_tokens=max_tokens,
            temperature=0.8, seed=i, stream=True, extra_body={"ignore_eos": True},
        ) as resp:
            async for line in resp.iter_lines():
                lines.append(line)
                if line.startswith("data: {") and not rid:
                    rid = json.loads(line.removeprefix("data: "))["id"] + "-0"
                    seen.release()
        return rid, lines

    async def main() -> list[tuple[str, list[str]]]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        try:
            tasks = [asyncio.ensure_future(one(client, i)) for i in range(count)]
            for _ in range(count):  # every request is running (it has sent a chunk)
                await asyncio.wait_for(seen.acquire(), 60)
            snapshot["victim"], snapshot["survivor"] = set(victim.held()), set(survivor.held())
            os.kill(victim.pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)
        finally:
            await client.close()

    seen = asyncio.Semaphore(0)
    results = asyncio.run(main())
    assert snapshot["victim"] and snapshot["survivor"], snapshot  # both held requests when one died
    for rid, lines in results:
        data = [x for x in lines if x]
        if rid in snapshot["victim"]:
            errors = [json.loads(x.removeprefix("data: "))["error"] for x in data if x.startswith('data: {"error"')]
            assert len(errors) == 1 and data[-1] == "data: [DONE]", data[-3:]
            assert "replica 1" in errors[0]["message"] and "SIGKILL" in errors[0]["message"], errors
        else:
            assert rid in snapshot["survivor"]
            assert not any(x.startswith('data: {"error"') for x in data)
            chunks = [json.loads(x.removeprefix("data: ")) for x in data[:-1]]
            assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 0
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    status, health = http(url + "/health")
    assert status == 200 and health["status"] == "degraded"
    assert [r["serving"] for r in health["replicas"]] == [True, False] and "SIGKILL" in health["replicas"][1]["error"]
    for i in range(4):  # the survivor takes everything now
        status, body = http(url + "/v1/completions", {"prompt": WORDS[i], "max_tokens": 3})
        assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    text = http(url + "/metrics")[1]
    assert metric(text, "corerun:engine_up", engine="0") == 1 and metric(text, "corerun:engine_up", engine="1") == 0
    _idle(front)

    front.shutdown()  # (the fixture's shutdown after this one finds nothing left)
    assert _left(processes) == []
