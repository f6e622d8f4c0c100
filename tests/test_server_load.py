"""The server under load: 64 concurrent streaming clients x 8 requests each, some hanging up mid-stream.

Every stream that runs to its end must be complete and well-formed on the wire (SSE ``data:`` lines of
JSON chunks, one finish_reason, the usage chunk, ``data: [DONE]`` last); ``/metrics`` must count
exactly the prompt tokens and requests sent; afterwards the engine holds no request and no block.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from corerun import LLM  # noqa: E402
from corerun.testing import assert_idle, make_llm  # noqa: E402
from tests.helpers.engine_testing import no_hang  # noqa: E402,F401
from tests.helpers.serving import SERVING, http, metric, running_server, tiny_chat_model  # noqa: E402

CLIENTS, REQUESTS = 64, 8
WORDS = "the cat sat on a mat and then the dog ran off to see what it had".split()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LLM, str]]:
    llm = make_llm(tiny_chat_model(tmp_path_factory.mktemp("load")), **SERVING, kv_cache={"num_blocks": 640})
    with running_server(llm) as url:
        yield llm, url
    llm.shutdown()


async def _one(client: Any, prompt: str, max_tokens: int, hang_up_after: int | None) -> dict[str, Any]:
    """One streamed completion read as raw SSE lines; with ``hang_up_after`` the client leaves after that many chunks."""
    lines: list[str] = []
    async with client.completions.with_streaming_response.create(
        model="tiny-llama", prompt=prompt, max_tokens=max_tokens, temperature=0.7, seed=len(prompt), stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ) as resp:
        async for line in resp.iter_lines():
            lines.append(line)
            if hang_up_after is not None and sum(1 for x in lines if x) >= hang_up_after:
                return {"hung_up": True, "lines": lines}
    return {"hung_up": False, "lines": lines}


def _check_complete(lines: list[str], prompt_tokens: int, max_tokens: int) -> int:
    """Assert one finished stream is well-formed; return its completion tokens."""
    data = [x for x in lines if x]
    assert all(x.startswith("data: ") for x in data), data[:3]
    assert data[-1] == "data: [DONE]" and data.count("data: [DONE]") == 1
    chunks = [json.loads(x.removeprefix("data: ")) for x in data[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "text_completion" for c in chunks)
    *body, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == prompt_tokens
    assert usage["usage"]["completion_tokens"] == max_tokens  # ignore_eos: exactly max_tokens
    reasons = [c["choices"][0]["finish_reason"] for c in body]
    assert reasons[-1] == "length" and not any(reasons[:-1])
    assert all(c["usage"] is None and [ch["index"] for ch in c["choices"]] == [0] for c in body)
    assert "".join(c["choices"][0]["text"] for c in body)
    return usage["usage"]["completion_tokens"]


def plan_load(clients: int, requests: int) -> list[tuple[int, str, int, int | None]]:
    """``(client, prompt, max_tokens, hang_up_after)`` for each request; one in five hangs up after 1-3 chunks."""
    rng = random.Random(0)
    plan = []
    for c in range(clients):
        for r in range(requests):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
            hang = rng.randint(1, 3) if (c + r) % 5 == 0 else None
            plan.append((c, prompt, rng.randint(4, 16), hang))
    return plan


def run_load(url: str, plan: list[tuple[int, str, int, int | None]], tok: Any) -> tuple[int, int, int]:
    """Each client sends its requests one after another, all clients at once; every stream that ran to
    its end is checked. Returns ``(complete, hung up, generated tokens)``."""
    clients = max(c for c, *_ in plan) + 1

    async def client_run(c: int) -> list[dict[str, Any]]:
        # The client's default 5 s connect timeout is a wait on this test's own event loop, which a busy
        # machine can starve with 64 streams to read: the server is under test, not the loop's latency.
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0,
                                    timeout=openai.Timeout(240.0, connect=120.0))
        try:
            return [await _one(client, p, m, h) for cc, p, m, h in plan if cc == c]
        finally:
            await client.close()

    async def main() -> list[list[dict[str, Any]]]:
        return await asyncio.gather(*(client_run(c) for c in range(clients)))

    results = asyncio.run(main())
    complete = hung = generated = 0
    for c, runs in enumerate(results):
        mine = [(p, m, h) for cc, p, m, h in plan if cc == c]
        for (prompt, max_tokens, hang), res in zip(mine, runs):
            if res["hung_up"]:
                hung += 1
                continue
            assert hang is None or hang >= max_tokens  # left only if it had more chunks to wait for
            generated += _check_complete(res["lines"], len(tok.encode(prompt)), max_tokens)
            complete += 1
    return complete, hung, generated


def test_64_clients_x_8_streams_with_hang_ups(served: tuple[LLM, str]) -> None:
    llm, url = served
    tok = llm.get_tokenizer()
    plan = plan_load(CLIENTS, REQUESTS)
    before = http(url + "/metrics")[1]
    complete, hung, generated = run_load(url, plan, tok)
    assert complete + hung == CLIENTS * REQUESTS and hung > 0
    assert_idle(llm, timeout=30)  # every request over, every block back: nothing leaked
    after = http(url + "/metrics")[1]

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == sum(len(tok.encode(p)) for _, p, _, _ in plan)
    assert delta("vllm:request_success_total") == CLIENTS * REQUESTS
    assert delta("vllm:e2e_request_latency_seconds_count") == CLIENTS * REQUESTS
    assert complete <= delta("vllm:time_to_first_token_seconds_count") <= CLIENTS * REQUESTS
    assert delta("vllm:request_success_total", finished_reason="length") >= complete
    assert delta("vllm:request_success_total", finished_reason="abort") <= hung
    assert delta("vllm:generation_tokens_total") >= generated
    assert delta("corerun:requests_rejected_total") == 0
    assert metric(after, "vllm:num_requests_running") == metric(after, "vllm:num_requests_waiting") == 0
    assert metric(after, "vllm:kv_cache_usage_perc") == 0
