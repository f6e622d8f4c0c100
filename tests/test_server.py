"""``corerun serve``: the real server (uvicorn on a free port) driven by the official ``openai`` client.

References: greedy and seeded outputs against ``LLM.generate`` on the same engine; logprobs against
Hugging Face transformers' float32 logits; stop strings against the text of the unstopped output.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Iterator

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from corerun import LLM, SamplingParams  # noqa: E402
from corerun.testing import assert_idle, make_llm  # noqa: E402
from tests.helpers.engine_testing import no_hang  # noqa: E402,F401
from tests.helpers.serving import SERVING, http, metric, running_server, tiny_chat_model  # noqa: E402
from tests.helpers.tiny_models import hf_logits  # noqa: E402

PROMPTS = ["hello there", "the cat sat on the mat", "a"]
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_chat_model(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def llm(folder: Any) -> Iterator[LLM]:
    llm = make_llm(folder, **SERVING, kv_cache={"num_blocks": 128},
                   scheduler={"max_model_len": MAX_MODEL_LEN}, server={"max_request_bytes": 20_000})
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def url(llm: LLM) -> Iterator[str]:
    with running_server(llm) as u:
        yield u


@pytest.fixture
def client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)


def _reference(llm: LLM, prompt: Any, **params: Any) -> Any:
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def test_models_and_health(client: Any, url: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-llama"]
    assert http(url + "/health") == (200, {"status": "ok"})


@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_equals_llm_generate(llm: LLM, client: Any, stream: bool) -> None:
    for prompt in PROMPTS:
        ref = _reference(llm, prompt, temperature=0, max_tokens=12, ignore_eos=True).outputs[0]
        kw = dict(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
            assert reasons[-1] == "length" and not any(reasons[:-1])
            usage = chunks[-1].usage
            assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
        else:
            r = client.completions.create(**kw)
            text, usage = r.choices[0].text, r.usage
            assert r.choices[0].finish_reason == "length"
        assert text == ref.text
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(llm.get_tokenizer().encode(prompt)), 12)


def test_completion_token_id_prompts_batch(llm: LLM, client: Any) -> None:
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    r = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=6, temperature=0, n=2,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(2 * len(ids)))
    for i, p in enumerate(ids):
        ref = _reference(llm, p, temperature=0, max_tokens=6, ignore_eos=True).outputs[0].text
        assert [r.choices[2 * i + j].text for j in range(2)] == [ref, ref]
    assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 2 * 6 * len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_uses_the_template_and_equals_llm_generate(llm: LLM, client: Any, stream: bool) -> None:
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "the cat"}]
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")  # the template's own generation prompt
    ref = _reference(llm, ids, temperature=0, max_tokens=10, ignore_eos=True).outputs[0]
    kw = dict(model="tiny-llama", messages=messages, max_completion_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
        text = r.choices[0].message.content
        assert r.usage.prompt_tokens == len(ids)
    assert text == ref.text


def test_n3_seeded_matches_llm_generate_and_repeats(llm: LLM, client: Any) -> None:
    kw = dict(model="tiny-llama", prompt="the cat sat", max_tokens=8, temperature=1.0, seed=1234, n=3,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3  # three samples, not one copied
    ref = _reference(llm, "the cat sat", temperature=1.0, seed=1234, n=3, max_tokens=8, ignore_eos=True)
    assert texts == [c.text for c in ref.outputs]
    streamed = ["", "", ""]
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] += c.text
    assert streamed == texts
    assert_idle(llm, timeout=30)


def test_seed_reproduces_over_http_and_offline(llm: LLM, client: Any) -> None:
    kw = dict(temperature=0.9, top_p=0.95, seed=7, max_tokens=10)
    r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hello"}],
                                       extra_body={"ignore_eos": True, "top_k": 20}, **kw)
    tok = llm.get_tokenizer()
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                             add_generation_prompt=True), add_special_tokens=False)
    assert r.choices[0].message.content == _reference(llm, ids, ignore_eos=True, top_k=20, **kw).outputs[0].text


def _boundary_stop(llm: LLM, prompt: str, max_tokens: int) -> tuple[str, str]:
    """The greedy text, and a 2-3 character string of it that straddles a token boundary (found once only)."""
    out = _reference(llm, prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True).outputs[0]
    tok = llm.get_tokenizer()
    pieces = [tok.decode([t]) for t in out.token_ids]
    assert "".join(pieces) == out.text
    pos = 0
    for i, piece in enumerate(pieces[:-1]):
        pos += len(piece)
        for left, right in ((1, 1), (1, 2), (2, 1)):
            s = out.text[pos - left : pos + right]
            if i >= 2 and len(s) == left + right and out.text.count(s) == 1 and pos - left >= 0:
                return out.text, s
    pytest.skip("no unique string across a token boundary in this output")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundary(llm: LLM, client: Any, stream: bool, include: bool) -> None:
    full, stop = _boundary_stop(llm, "the cat sat on the mat", 24)
    expect = full[: full.index(stop) + (len(stop) if include else 0)]
    kw = dict(model="tiny-llama", prompt="the cat sat on the mat", max_tokens=24, temperature=0,
              stop=["zzzz", stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
    if stream:
        chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "stop"
        seen = ""
        for c in chunks:  # no chunk ever showed part of a removed stop string
            seen += c.choices[0].text
            assert expect.startswith(seen)
    else:
        r = client.completions.create(**kw)
        text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].model_extra.get("stop_reason") == stop
    assert text == expect
    # the engine itself: the same through LLM.generate
    ref = _reference(llm, "the cat sat on the mat", temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                     include_stop_str_in_output=include).outputs[0]
    assert (ref.text, ref.finish_reason, ref.stop_reason) == (expect, "stop", stop)


def test_logprobs_match_transformers(llm: LLM, client: Any, folder: Any) -> None:
    tok = llm.get_tokenizer()
    prompt = "the cat sat"
    r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    ids = tok.encode(prompt)
    out_ids = [tok.convert_tokens_to_ids(t) for t in lp.tokens]
    logits = hf_logits(folder, ids + out_ids).double()
    ref = torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)
    for j, t in enumerate(out_ids):
        assert t == int(ref[j].argmax())  # greedy
        assert abs(lp.token_logprobs[j] - ref[j, t].item()) < 1e-4
        top = torch.topk(ref[j], 3)
        assert [tok.convert_tokens_to_ids(k) for k in lp.top_logprobs[j]] == top.indices.tolist()
        assert max(abs(v - w) for v, w in zip(lp.top_logprobs[j].values(), top.values.tolist())) < 1e-4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]
    # chat: logprobs + top_logprobs, streamed, same numbers per token
    c = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, stream=True,
                                       extra_body={"ignore_eos": True})
    content = [x for ch in c for x in (ch.choices[0].logprobs.content if ch.choices[0].logprobs else [])]
    assert len(content) == 5
    for x in content:
        assert len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob >= x.top_logprobs[1].logprob
        assert x.logprob == pytest.approx(x.top_logprobs[0].logprob)  # greedy: the chosen one ranks first


BAD = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_token": 5}, "max_token"),  # a typo is refused, not ignored
    ({"prompt": [1.5]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": 50}, "logprobs"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"999": 1}}, "logit_bias"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ({"seed": "x"}, "seed"),
    ({"prompt": "%" * (MAX_MODEL_LEN + 5)}, "prompt"),  # one token per character
    ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"echo": True}, "echo"),
]


@pytest.mark.parametrize(("fields", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_completion_field_gives_400_naming_it(llm: LLM, url: str, fields: dict, param: str) -> None:
    status, body = http(url + "/v1/completions", {"model": "tiny-llama", "prompt": "hi", **fields})
    assert status == 400, body
    assert body["error"]["param"] == param and param in body["error"]["message"], body
    assert body["error"]["type"] == "invalid_request_error"


CHAT_BAD = [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # auto, and this model has no parser
]


@pytest.mark.parametrize(("fields", "param"), CHAT_BAD, ids=[p for _, p in CHAT_BAD])
def test_bad_chat_field_gives_400_naming_it(url: str, fields: dict, param: str) -> None:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], **fields}
    status, answer = http(url + "/v1/chat/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and param in answer["error"]["message"], answer


def test_other_refusals_and_the_engine_serves_on(llm: LLM, client: Any, url: str) -> None:
    status, body = http(url + "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert status == 404 and body["error"]["param"] == "model" and "tiny-llama" in body["error"]["message"]
    status, body = http(url + "/v1/completions", raw=b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]
    status, body = http(url + "/v1/completions", {"model": "tiny-llama", "prompt": "x" * 30_000})
    assert status == 413 and "max_request_bytes" in body["error"]["message"]
    status, body = http(url + "/v1/completions", raw=b'{"model": "tiny-llama", "prompt": "a\\ud800b"}')
    assert status == 400 and body["error"]["param"] == "prompt" and "surrogate" in body["error"]["message"]
    status, body = http(url + "/v1/chat/completions", raw=b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\udfff"}]}')
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = http(url + "/v1/completions", raw=b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-llama", prompt="hi", temperature=-2)
    assert err.value.status_code == 400 and "temperature" in str(err.value)
    r = client.completions.create(model="tiny-llama", prompt="hi", max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    assert_idle(llm, timeout=30)
    metrics = http(url + "/metrics")[1]
    assert metric(metrics, "corerun:requests_rejected_total", reason="invalid") >= 5


def test_disconnect_mid_stream_aborts_and_frees(llm: LLM, url: str) -> None:
    before = metric(http(url + "/metrics")[1], "vllm:request_success_total", finished_reason="abort")
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
    with client.completions.with_streaming_response.create(
        model="tiny-llama", prompt="hello", max_tokens=MAX_MODEL_LEN - 8, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    ) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first.removeprefix("data: "))["choices"][0]["finish_reason"] is None
    assert_idle(llm, timeout=30)  # aborted: its blocks are back
    after = metric(http(url + "/metrics")[1], "vllm:request_success_total", finished_reason="abort")
    assert after == before + 1


def test_overload_gives_503_at_once(folder: Any) -> None:
    llm = make_llm(folder, **SERVING, scheduler={"max_num_seqs": 1, "max_model_len": 256},
                   server={"max_waiting_requests": 1})
    try:
        with running_server(llm) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
            # 240 tokens, one step each: the first request outlasts the next two requests' round trips
            kw = dict(model="tiny-llama", prompt="hello", max_tokens=240, temperature=0, stream=True,
                      extra_body={"ignore_eos": True})
            running = client.completions.create(**kw)
            next(iter(running))  # it has a token: it runs, and holds the only seat
            waiting = client.completions.create(**kw)  # accepted (headers sent): it waits
            with pytest.raises(openai.APIStatusError) as err:
                client.completions.create(**kw)
            assert err.value.status_code == 503 and "max_waiting_requests=1" in str(err.value)
            assert err.value.response.headers["retry-after"] == "1"
            running.close()
            assert sum(1 for ch in waiting if ch.choices) >= 1  # the waiting one is then served, whole
            metrics = http(url + "/metrics")[1]
            assert metric(metrics, "corerun:requests_rejected_total", reason="overloaded") == 1
            assert_idle(llm, timeout=30)
    finally:
        llm.shutdown()


def test_online_bench_against_the_server(llm: LLM, url: str) -> None:
    from corerun.server.bench_client import report, run

    assert_idle(llm, timeout=30)
    before = http(url + "/metrics")[1]
    s = asyncio.run(run(url, num_prompts=12, input_len=(6, 6), output_len=(5, 5), request_rate=float("inf"),
                        max_concurrency=4, seed=3, temperature=0.0, vocab=256))
    assert (s["completed"], s["failed"], s["model"]) == (12, 0, "tiny-llama")
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (72, 60)
    after = http(url + "/metrics")[1]
    assert metric(after, "vllm:prompt_tokens_total") - metric(before, "vllm:prompt_tokens_total") == 72
    assert metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total") == 60
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[key]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"]
    assert s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"]
    assert "TTFT" in report(s) and s["output_throughput"] > 0


def test_non_streamed_request_aborted_when_the_client_leaves(llm: LLM, url: str) -> None:
    assert_idle(llm, timeout=30)

    def ended() -> tuple[float, float]:
        text = http(url + "/metrics")[1]
        return tuple(metric(text, "vllm:request_success_total", finished_reason=r) for r in ("abort", "length"))

    before = ended()
    impatient = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=0.3)
    with pytest.raises(openai.APITimeoutError):  # the client gives up long before 40 x 125 tokens
        impatient.completions.create(model="tiny-llama", prompt=[5, 6], max_tokens=MAX_MODEL_LEN - 3, n=40,
                                     temperature=1.0, extra_body={"ignore_eos": True})
    assert_idle(llm, timeout=30)
    aborted, lengths = (a - b for a, b in zip(ended(), before))
    # every sample of it ends and is counted: those the tiny model finished within the client's 0.3 s
    # (the head and the first forks can reach 125 tokens on a quiet machine) as length, the rest as abort
    assert aborted + lengths == 40 and aborted >= 1, (aborted, lengths)


def test_engine_fault_is_a_500_for_that_request_only(folder: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import corerun.plugin.registry as registry_module
    from corerun.plugin.registry import Registry
    from tests.helpers import faulty_plugins

    reg = Registry.from_environment()
    reg.register_module(faulty_plugins, plugin="faulty", distribution=faulty_plugins.DISTRIBUTION, version="0")
    monkeypatch.setattr(registry_module, "_default", reg)
    llm = make_llm(folder, **{**SERVING, "sampler": {"name": "faulty_sampler", "options": {"fail_at": 3, "times": 2}}},
                   scheduler={"max_model_len": MAX_MODEL_LEN})
    try:
        with running_server(llm) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
            kw = dict(model="tiny-llama", prompt="hello", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
            # sampling calls 1, 2: two tokens streamed; call 3 fails: an error event, then [DONE]
            with client.completions.with_streaming_response.create(stream=True, **kw) as resp:
                data = [x.removeprefix("data: ") for x in resp.iter_lines() if x]
            assert resp.status_code == 200 and data[-1] == "[DONE]"
            err = json.loads(data[-2])["error"]
            assert "faulty_sampler" in err["message"] and "injected" in err["message"] and err["code"] == "engine_error"
            assert [json.loads(x)["choices"][0]["finish_reason"] for x in data[:-2]] == [None, None]
            # call 4 fails: a non-streamed request gets 500 (the server's fault, not the request's)
            body = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            status, answer = http(url + "/v1/completions", body)
            assert status == 500 and "faulty_sampler" in answer["error"]["message"]
            r = client.completions.create(**kw)  # the engine serves on
            assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
            assert_idle(llm, timeout=30)
    finally:
        llm.shutdown()


FIELDS = ["prompt", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "seed", "stop", "stop_token_ids", "include_stop_str_in_output", "logit_bias", "ignore_eos",
          "min_tokens", "stream", "stream_options", "logprobs", "echo", "user", "model"]
CHAT_FIELDS = [f for f in FIELDS if f not in ("prompt", "logprobs", "echo")] + [
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "chat_template_kwargs", "tools"]
VALUES = [None, True, False, -1, 0, 1, 3, 2.5, -0.5, 10**30, float("inf"), "x", "", [], [1], [[1, 2]], ["a", ""],
          {"a": 1}, {"3": 1.0}, {"include_usage": "yes"}, [{"role": "user"}], [{"role": "user", "content": 5}]]


def test_random_bodies_never_get_a_500(llm: LLM, url: str) -> None:
    """Whatever a client sends, the answer is 200 or a 4xx naming the problem; never the server's 500."""
    import random

    rng = random.Random(1)
    statuses: dict[int, int] = {}
    for i in range(120):
        chat = i % 2 == 1
        body: dict[str, Any] = ({"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]} if chat
                                else {"model": "tiny-llama", "prompt": "hi"})
        body["max_tokens"] = 2
        for field in rng.sample(CHAT_FIELDS if chat else FIELDS, rng.randint(1, 3)):
            body[field] = rng.choice(VALUES)
        raw = json.dumps(body, allow_nan=True).encode()  # (inf travels as the non-standard Infinity)
        status, answer = http(url + ("/v1/chat/completions" if chat else "/v1/completions"), raw=raw)
        statuses[status] = statuses.get(status, 0) + 1
        assert status in (200, 400, 404), (body, status, answer)
        if status != 200:
            assert answer["error"]["message"], answer
    assert statuses.get(400, 0) > 30 and statuses.get(200, 0) > 5, statuses
    assert_idle(llm, timeout=30)


def test_sampling_fields_reach_the_engine(llm: LLM, client: Any) -> None:
    tok = llm.get_tokenizer()
    q = tok.convert_tokens_to_ids("Q")
    r = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=4, temperature=1.0,
                                  logit_bias={str(q): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == "QQQQ"
    # EOS forced by the bias, held back by min_tokens for three tokens: the fourth ends it
    r = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=8, temperature=0,
                                  logit_bias={str(tok.eos_token_id): 100}, extra_body={"min_tokens": 3})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 4)
    r = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=8, temperature=0,
                                  logit_bias={str(q): 100}, extra_body={"stop_token_ids": [q]})
    assert (r.choices[0].finish_reason, r.choices[0].model_extra["stop_reason"], r.usage.completion_tokens) == ("stop", q, 1)


def test_structured_output_fields_reach_the_engine(client: Any, url: str) -> None:
    """OpenAI's response_format and vLLM's structured_outputs / guided_* constrain the output; a spec
    that does not compile, or two ways at once, is a 400 naming the field."""
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yz"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a", "n"], "additionalProperties": False}
    r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=60,
                                       response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    value = json.loads(r.choices[0].message.content)
    assert value["a"] in ("x", "yz") and 0 <= value["n"] <= 9 and set(value) == {"a", "n"}, value
    r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=60,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=20, temperature=1.0, seed=3, n=2,
                                  extra_body={"guided_choice": ["yes", "no way"]})
    assert [c.text in ("yes", "no way") for c in r.choices] == [True, True], r.choices
    r = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=20, temperature=1.0,
                                  extra_body={"structured_outputs": {"regex": "[ab]{3}c"}})
    assert len(r.choices[0].text) == 4 and set(r.choices[0].text[:3]) <= {"a", "b"} and r.choices[0].text[3] == "c"
    status, body = http(url + "/v1/completions", {"model": "tiny-llama", "prompt": "hi", "guided_regex": "[a-"})
    assert status == 400 and "structured_outputs.regex does not compile" in body["error"]["message"], body
    status, body = http(url + "/v1/completions", {"model": "tiny-llama", "prompt": "hi", "guided_regex": "a",
                                                  "guided_choice": ["b"]})
    assert status == 400 and body["error"]["param"] == "guided_regex", body


def test_speculation_counters_in_metrics(folder: Any, url: str) -> None:
    """With n-gram speculation on, /metrics carries vLLM's spec_decode counters, equal to the engine's
    own counts after the requests finish; without it (the module's server) the series are absent."""
    assert "vllm:spec_decode_num_drafts_total" not in http(url + "/metrics")[1]
    spec = make_llm(folder, **SERVING, kv_cache={"num_blocks": 128}, scheduler={"max_model_len": 256},
                    speculative={"method": "ngram", "num_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    try:
        with running_server(spec) as spec_url:
            repeated = list(range(3, 243))  # most ids the model may sample occur in the prompt: drafts follow them
            status, body = http(spec_url + "/v1/completions", {"model": body_model(spec_url), "prompt": repeated,
                                                                "max_tokens": 12, "temperature": 0})
            assert status == 200, body
            assert_idle(spec, timeout=30)
            stats = spec.engine.spec_stats
            text = http(spec_url + "/metrics")[1]
            assert stats.num_draft_tokens > 0
            assert metric(text, "vllm:spec_decode_num_drafts_total") == stats.num_drafts
            assert metric(text, "vllm:spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
            assert metric(text, "vllm:spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens
            assert 0 <= stats.num_accepted_tokens <= stats.num_draft_tokens
    finally:
        spec.shutdown()


def body_model(url: str) -> str:
    return http(url + "/v1/models")[1]["data"][0]["id"]
