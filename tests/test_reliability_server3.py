"""The server against hostile clients, round three (issue 28, server half).

Each test drives the real server (uvicorn on 127.0.0.1) with the ``openai`` client or raw
``http.client`` requests.  References: transformers' own ``apply_chat_template`` for what a chat
template renders, ``LLM.generate`` for what a request generates, and OpenAI's documented error object.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.client import HTTPConnection
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from corerun import LLM, SamplingParams, hookimpl  # noqa: E402
from corerun.server import chat_template as CT  # noqa: E402
from corerun.testing import assert_idle, make_llm  # noqa: E402
from tests.helpers.engine_testing import no_hang  # noqa: E402,F401
from tests.helpers.serving import SERVING, http, running_server, server_and_url, tiny_chat_model  # noqa: E402

MAX_MODEL_LEN = 64
# make_llm's overrides for this file: a 64-token context, and the limits the hostile template meets
OVERRIDES: dict[str, Any] = dict(SERVING, scheduler={"max_model_len": MAX_MODEL_LEN})
TEMPLATE_LIMITS: dict[str, Any] = {"chat_template_max_chars": 10_000, "chat_template_timeout_s": 0.3}

# The model's own template: plain for ordinary messages; a string bomb, a CPU burner or a doubling loop
# when the first message asks for one (what a broken or hostile template in a model folder could do).
HOSTILE_TEMPLATE = (
    "{% set first = messages[0]['content'] %}"
    "{% if first == 'bomb' %}{{ 'a' * 100000 }}"
    "{% elif first == 'loops' %}{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}"
    "{% elif first == 'double' %}{% set ns = namespace(s='ab') %}{% for i in range(30) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}"
    "{% else %}{% if enable_thinking %}<think>{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{% else %}<|assistant|>{% endif %}"
    "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}{% endif %}"
)


def set_template(folder: Path, template: str) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.chat_template = template
    tok.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return set_template(tiny_chat_model(tmp_path_factory.mktemp("server3")), HOSTILE_TEMPLATE)


@pytest.fixture(scope="module")
def served(folder: Path) -> Iterator[tuple[LLM, str]]:
    llm = make_llm(folder, **OVERRIDES, server=TEMPLATE_LIMITS)
    try:
        with running_server(llm) as u:
            yield llm, u
    finally:
        llm.shutdown()


@pytest.fixture
def llm(served: tuple[LLM, str]) -> LLM:
    return served[0]


@pytest.fixture
def url(served: tuple[LLM, str]) -> str:
    return served[1]


@pytest.fixture
def client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)


def chat(url: str, content: str, **body: Any) -> tuple[int, Any]:
    return http(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": content}], "max_tokens": 2,
                                               **body})


def raw(url: str, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
        ) -> tuple[Any, Any]:
    """One request by http.client, headers exactly as given (JSON content type unless replaced)."""
    conn = HTTPConnection(url.removeprefix("http://"), timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        text = resp.read()
    finally:
        conn.close()
    try:
        return resp, json.loads(text)
    except ValueError:
        return resp, text


def tok_ids(llm: LLM, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
    """transformers' rendering of the model's template, tokenized as the server does (the reference)."""
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tok.encode(text, add_special_tokens=False)


# ------------------------------------------------------------------ 1. chat templates

def test_chat_template_in_kwargs_is_refused(url: str) -> None:
    status, body = chat(url, "hi", chat_template_kwargs={"chat_template": "PWNED {{ messages }}"})
    assert status == 400, body
    assert body["error"]["param"] == "chat_template_kwargs"
    assert "chat_template_kwargs.chat_template" in body["error"]["message"]


@pytest.mark.parametrize("kwargs, named", [
    ({"tokenize": True}, "chat_template_kwargs.tokenize: unknown key; allowed keys are"),
    ({"enable_thinking": [1, 2]}, "chat_template_kwargs.enable_thinking: must be bool or null, got list"),
    ({"reasoning_effort": "x" * 5000}, "chat_template_kwargs.reasoning_effort: 5000 characters, at most 4096"),
])
def test_chat_template_kwargs_allow_list(url: str, kwargs: dict[str, Any], named: str) -> None:
    status, body = chat(url, "hi", chat_template_kwargs=kwargs)
    assert status == 400 and body["error"]["param"] == "chat_template_kwargs", body
    assert body["error"]["message"].startswith(named)


def test_allowed_kwarg_reaches_the_template_as_transformers_renders_it(llm: LLM, client: Any) -> None:
    messages = [{"role": "user", "content": "the cat"}]
    for kwargs in ({}, {"enable_thinking": True}):
        ids = tok_ids(llm, messages, **kwargs)
        r = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=3, temperature=0,
                                           extra_body={"chat_template_kwargs": kwargs, "ignore_eos": True})
        assert r.usage.prompt_tokens == len(ids)
        ref = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
        assert r.choices[0].message.content == ref.outputs[0].text
    assert len(tok_ids(llm, messages, enable_thinking=True)) > len(tok_ids(llm, messages))  # the kwarg mattered


@pytest.mark.parametrize("content, named", [
    ("bomb", "built a repetition of 100000 characters, above server.chat_template_max_chars=10000"),
    ("double", "built a string of 16384 characters, above server.chat_template_max_chars=10000"),
    ("loops", "ran longer than server.chat_template_timeout_s=0.3"),
])
def test_model_template_limits(llm: LLM, url: str, client: Any, content: str, named: str) -> None:
    status, body = chat(url, content)
    assert status == 400 and body["error"]["param"] == "messages", body
    assert named in body["error"]["message"]
    r = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")  # the server serves on
    assert_idle(llm, timeout=30)


class _Tok:
    special_tokens_map = {"bos_token": "<s>", "eos_token": "</s>"}

    def __init__(self, template: str) -> None:
        self.chat_template = template


@pytest.mark.parametrize("template, named", [
    ("{{ 'a' * 10**9 }}", "a repetition of 1000000000 characters"),
    ("{{ 10 ** (10 ** 9) }}", "to the power 1000000000"),
    ("{{ '%999999999s' % 'a' }}", "a formatted field of 999999999"),
    ("{{ '{:>999999999}'.format('a') }}", "a formatted field of 999999999"),
    ("{{ 'a' | center(999999999) }}", "a 'center' width of 999999999"),
    ("{{ 'a' | indent(999999999) }}", "a 'indent' width of 999999999"),
    ("{{ '%999999999s' | format('a') }}", "a formatted field of 999999999"),
    ("{{ ['a'] * 999999999 }}", "a repetition of 999999999"),
    ("{% for i in range(100000) %}xxxxxxxx{% endfor %}", "wrote more than server.chat_template_max_chars=1000"),
])
def test_sandbox_refuses_before_allocating(template: str, named: str) -> None:
    with pytest.raises(CT.TemplateLimit, match="chat_template") as err:
        CT.render(_Tok(template), [], add_generation_prompt=True, kwargs={}, max_chars=1000, timeout_s=5)
    assert named in str(err.value)


def test_sandbox_keeps_the_sandbox_and_transformers_globals() -> None:
    import jinja2

    with pytest.raises(jinja2.exceptions.SecurityError):
        CT.render(_Tok("{{ ''.__class__.__mro__ }}{{ cycler.__init__.__globals__ }}"), [], add_generation_prompt=True,
                  kwargs={}, max_chars=1000, timeout_s=5)
    with pytest.raises(jinja2.exceptions.TemplateError, match="roles must alternate"):
        CT.render(_Tok("{{ raise_exception('roles must alternate') }}"), [], add_generation_prompt=True, kwargs={},
                  max_chars=1000, timeout_s=5)


def test_sandbox_renders_as_transformers(folder: Path) -> None:
    """Templates with loop controls, namespaces, tojson, bos_token and {% generation %}: the same text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 😀 \"q\""},
                {"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]
    templates = [
        "{{ bos_token }}{% for m in messages %}{% if loop.first and m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m.role | upper }}: {{ m.content | trim }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}",
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ m | tojson }}"
        "{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endif %}{% endfor %}"
        "{{ ns.n }}{{ '%-6s|' % 'ab' }}{{ '{:>4}'.format(7) }}{{ 'x' * 3 }}{{ [1] + [2] }}",
    ]
    for template in templates:
        tok.chat_template = template
        want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        got = CT.render(tok, messages, add_generation_prompt=True, kwargs={}, max_chars=10_000, timeout_s=5)
        assert got == want


# ------------------------------------------------------------------ 8. deep JSON, 9. OpenAI compatibility

@pytest.mark.parametrize("depth", [65, 5000])
def test_deeply_nested_body_is_a_400(url: str, depth: int) -> None:
    raw = b'{"prompt": "x", "metadata": {"a": ' + b"[" * depth + b"]" * depth + b"}}"
    status, body = http(url + "/v1/completions", raw=raw)
    assert status == 400, body
    assert "nested" in body["error"]["message"] and "at most 64" in body["error"]["message"]


def test_models_retrieve(client: Any, url: str) -> None:
    m = client.models.retrieve("tiny-llama")
    assert (m.id, m.object, m.owned_by) == ("tiny-llama", "model", "corerun")
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("../etc/passwd")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


@pytest.mark.parametrize("method, path, status, allow", [
    ("GET", "/v1/nope", 404, None),
    ("POST", "/v2/completions", 404, None),
    ("GET", "/v1/completions", 405, "POST"),
    ("DELETE", "/v1/models", 405, "GET"),
])
def test_unknown_routes_and_methods_answer_openai_errors(url: str, method: str, path: str, status: int,
                                                         allow: str | None) -> None:
    resp, body = raw(url, method, path)
    assert resp.status == status
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"].startswith(f"{method} {path}: ")
    assert body["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert resp.getheader("Allow") == allow


@pytest.mark.parametrize("field, value", [("max_tokens", "3"), ("max_tokens", 2.0), ("n", "1"), ("seed", 1.0),
                                          ("top_k", True), ("stream", "true")])
def test_non_integers_refused(url: str, field: str, value: Any) -> None:
    for route, body in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        status, out = http(url + route, {**body, field: value})
        assert status == 400, out
        assert out["error"]["param"] == field and out["error"]["message"].startswith(f"{field}: ")


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "("}, "guided_regex"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
])
def test_structured_output_compile_errors_name_their_param(url: str, extra: dict[str, Any], param: str) -> None:
    pytest.importorskip("xgrammar")
    status, body = chat(url, "hi", **extra)
    assert status == 400, body
    assert body["error"]["param"] == param
    assert "does not compile" in body["error"]["message"]


# ------------------------------------------------------------------ 5. web pages, DNS rebinding, API keys

COMPLETION = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()


def test_cross_origin_simple_post_is_refused(url: str) -> None:
    """A page on another origin can POST text/plain without a preflight: it must not be served."""
    resp, body = raw(url, "POST", "/v1/completions", COMPLETION,
                     {"Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert resp.status == 403 and body["error"]["code"] == "origin_not_allowed", body
    assert "'http://evil.example'" in body["error"]["message"] and "allowed_origins" in body["error"]["message"]
    assert resp.getheader("Access-Control-Allow-Origin") is None
    resp, body = raw(url, "POST", "/v1/completions", COMPLETION, {"Origin": "http://evil.example"})
    assert resp.status == 403  # a JSON body does not make it allowed either


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None])
def test_json_routes_need_a_json_content_type(url: str, kind: str | None) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        resp, body = raw(url, "POST", path, COMPLETION, {"Content-Type": kind} if kind else {"Content-Type": ""})
        assert resp.status == 415, body
        assert body["error"]["message"] == f"Content-Type: {kind or ''!r}; a JSON route takes 'application/json'"
    resp, body = raw(url, "POST", "/v1/completions", COMPLETION, {"Content-Type": "application/json; charset=utf-8"})
    assert resp.status == 200, body


@pytest.mark.parametrize("host, status", [("evil.example", 403), ("evil.example:8000", 403), ("127.0.0.2", 403),
                                          ("127.0.0.1", 200), ("localhost", 200)])
def test_host_header_must_name_this_server(url: str, host: str, status: int) -> None:
    port = url.rsplit(":", 1)[1]
    resp, body = raw(url, "GET", "/v1/models", None, {"Host": f"{host}:{port}" if ":" not in host else host})
    assert resp.status == status, body
    if status == 403:
        assert body["error"]["code"] == "host_not_allowed" and "allowed_hosts" in body["error"]["message"]


@pytest.fixture(scope="module")
def guarded(folder: Path) -> Iterator[str]:
    llm = make_llm(folder, **OVERRIDES, server={**TEMPLATE_LIMITS, "api_key": "s3cret-key",
                   "allowed_origins": ["http://app.example:3000"], "allowed_hosts": ["corerun.internal"]})
    try:
        with running_server(llm) as u:
            yield u
    finally:
        llm.shutdown()


def test_api_key_on_every_v1_route(guarded: str) -> None:
    good = openai.OpenAI(base_url=guarded + "/v1", api_key="s3cret-key", max_retries=0)
    assert good.completions.create(model="tiny-llama", prompt="hi", max_tokens=2).choices[0].text is not None
    assert good.models.retrieve("tiny-llama").id == "tiny-llama"
    for key in ("wrong", "s3cret-key2", "s3cret-ke"):
        bad = openai.OpenAI(base_url=guarded + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            bad.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert err.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    for path in ("/v1/models", "/v1/models/tiny-llama", "/v1/nope"):
        resp, body = raw(guarded, "GET", path)
        assert resp.status == 401 and resp.getheader("WWW-Authenticate") == "Bearer", (path, body)
    assert raw(guarded, "GET", "/health")[0].status == 200  # probes need no key, as with vLLM


def test_online_bench_sends_the_api_key_from_the_environment(guarded: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from corerun.server.bench_client import run

    work = dict(num_prompts=2, input_len=(4, 4), output_len=(2, 2), request_rate=float("inf"), max_concurrency=2,
                seed=1, temperature=0.0, vocab=64)
    monkeypatch.delenv("CORERUN_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="HTTP 401.*CORERUN_API_KEY"):  # no key: the model lookup is refused
        asyncio.run(run(guarded, **work))
    monkeypatch.setenv("CORERUN_API_KEY", "s3cret-key")
    s = asyncio.run(run(guarded, **work))
    assert (s["completed"], s["failed"], s["model"]) == (2, 0, "tiny-llama")


def test_allowed_origin_gets_cors_and_others_do_not(guarded: str) -> None:
    auth = {"Authorization": "Bearer s3cret-key"}
    resp, body = raw(guarded, "POST", "/v1/completions", COMPLETION, {"Origin": "http://app.example:3000", **auth})
    assert resp.status == 200, body
    assert resp.getheader("Access-Control-Allow-Origin") == "http://app.example:3000"
    resp, _ = raw(guarded, "OPTIONS", "/v1/completions", None, {
        "Origin": "http://app.example:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert resp.status == 204 and "POST" in resp.getheader("Access-Control-Allow-Methods")
    assert "authorization" in resp.getheader("Access-Control-Allow-Headers")
    for origin in ("http://app.example:3001", "https://app.example:3000", "null"):
        resp, body = raw(guarded, "POST", "/v1/completions", COMPLETION, {"Origin": origin, **auth})
        assert resp.status == 403, (origin, body)
    port = guarded.rsplit(":", 1)[1]
    resp, body = raw(guarded, "GET", "/v1/models", None, {"Host": f"corerun.internal:{port}", **auth})
    assert resp.status == 200, body


def test_cli_takes_the_key_from_the_environment(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    import corerun.server.run as run
    from corerun.cli.serve import serve

    seen: dict[str, Any] = {}

    def fake_serve(llm: LLM, **_: Any) -> None:
        seen.update(llm.config.server.model_dump())
        llm.shutdown()

    monkeypatch.setattr(run, "serve", fake_serve)
    args = ["--model", str(folder), "--device", "cpu", "--dtype", "float32", "--attention", "torch",
            "--allowed-origins", "http://a.example", "--allowed-origins", "http://b.example"]
    result = CliRunner().invoke(serve, args, env={"CORERUN_API_KEY": "from-env"})
    assert result.exit_code == 0, result.output
    assert seen["api_key"] == "from-env" and seen["allowed_origins"] == ["http://a.example", "http://b.example"]
    result = CliRunner().invoke(serve, [*args, "--api-key", "from-flag"], env={"CORERUN_API_KEY": "from-env"})
    assert result.exit_code == 0 and seen["api_key"] == "from-flag"


# ------------------------------------------------------------------ 6. chat max_tokens default

def test_chat_default_max_tokens_fits_a_small_cache(folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    """32 tokens of cache under a 64-token context: the default is what the cache can hold, as vLLM's."""
    with caplog.at_level("WARNING", logger="corerun.server"):
        llm = make_llm(folder, **OVERRIDES, kv_cache={"num_blocks": 8})
        try:
            with running_server(llm) as u:
                messages = [{"role": "user", "content": "the cat"}]
                ids = tok_ids(llm, messages)
                c = openai.OpenAI(base_url=u + "/v1", api_key="-", max_retries=0)
                r = c.chat.completions.create(model="tiny-llama", messages=messages, temperature=0,
                                              extra_body={"ignore_eos": True})
                assert r.choices[0].finish_reason == "length"
                assert r.usage.completion_tokens == 8 * 4 + 1 - len(ids)  # K/V of prompt + output - 1 = 32 tokens
                ref = llm.generate([ids], SamplingParams(temperature=0, max_tokens=33 - len(ids), ignore_eos=True),
                                   use_tqdm=False)[0]
                assert r.choices[0].message.content == ref.outputs[0].text
                status, body = chat(u, "hi", max_tokens=40)  # asked for: still refused, naming what fits
                assert status == 400 and body["error"]["param"] == "max_tokens", body
        finally:
            llm.shutdown()
    warned = [r.getMessage() for r in caplog.records if r.name == "corerun.server" and "KV cache holds" in r.message]
    assert warned == ["the KV cache holds 32 tokens, less than one request of max_model_len=64: chat requests without "
                      "max_tokens get at most 33 tokens of prompt and output; raise kv_cache.num_blocks or memory to "
                      "serve the whole context"]


# ------------------------------------------------------------------ 3. shutdown past shutdown_timeout_s

def slow_steps(llm: LLM, seconds: float) -> None:
    """Every engine step takes at least ``seconds`` (a slow model), so requests are still running at shutdown."""
    step = llm.engine.step

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return step(*args, **kwargs)

    llm.engine.step = slow  # type: ignore[method-assign]


def test_shutdown_past_timeout_ends_every_client_explicitly(folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    llm = make_llm(folder, **OVERRIDES, server={**TEMPLATE_LIMITS, "shutdown_timeout_s": 1.0})
    slow_steps(llm, 0.05)  # 50 tokens take 2.5 s: past the 1 s timeout
    results: dict[str, Any] = {}
    started = threading.Barrier(4)
    body = {"model": "tiny-llama", "max_tokens": 50, "temperature": 0, "extra_body": {"ignore_eos": True}}

    def sdk_stream(url: str) -> None:
        c = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        text = ""
        try:
            for i, chunk in enumerate(c.completions.create(prompt="hi", stream=True, **body)):
                text += chunk.choices[0].text if chunk.choices else ""
                if i == 0:
                    started.wait()
            results["sdk_stream"] = ("finished", text)
        except openai.APIError as exc:
            results["sdk_stream"] = ("error", exc.message)

    def sdk_chat(url: str) -> None:
        c = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        started.wait()
        try:
            r = c.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **body)
            results["sdk_chat"] = ("finished", r.choices[0].finish_reason)
        except openai.APIStatusError as exc:
            results["sdk_chat"] = (exc.status_code, exc.body)

    def raw_stream(url: str) -> None:
        conn = HTTPConnection(url.removeprefix("http://"), timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "the cat", "stream": True, "max_tokens": 50,
                                                            "ignore_eos": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.readline()  # the first event: the stream is running
        started.wait()
        events = [line for line in resp.read().decode().split("\n\n") if line]
        conn.close()
        results["raw_stream"] = events

    with caplog.at_level("INFO"):
        with server_and_url(llm) as (server, url):
            threads = [threading.Thread(target=f, args=(url,)) for f in (sdk_stream, sdk_chat, raw_stream)]
            for t in threads:
                t.start()
            started.wait()
            time.sleep(0.2)  # the chat request is queued too
            server.should_exit = True  # as SIGTERM
            for t in threads:
                t.join(60)
    assert results["sdk_stream"][0] == "error" and "shutdown_timeout_s" in results["sdk_stream"][1], results
    status, err = results["sdk_chat"]
    assert status == 503 and err["code"] == "shutting_down", results
    events = results["raw_stream"]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
    assert all('"finish_reason":"length"' not in e for e in events)  # not passed off as a whole answer
    cut = [r.getMessage() for r in caplog.records if "cut off after server.shutdown_timeout_s=1.0" in r.getMessage()]
    assert len(cut) == 3, cut
    assert not [r for r in caplog.records if r.levelname == "ERROR" or r.exc_info], "no traceback, no cancel"
    assert not llm.engine.requests  # every request aborted, then the engine shut down


# ------------------------------------------------------------------ slow and numerous clients

@pytest.fixture(scope="module")
def tight(folder: Path) -> Iterator[str]:
    llm = make_llm(folder, **OVERRIDES, server={**TEMPLATE_LIMITS, "max_connections": 3, "read_timeout_s": 1.0})
    try:
        with running_server(llm) as u:
            yield u
    finally:
        llm.shutdown()


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=20)
    return sock


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_trickled_headers_get_408_and_the_connection_closed(tight: str) -> None:
    sock = connect(tight)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the rest
    answer = read_all(sock)  # returns once the server closes (the socket's own timeout is 20 s)
    sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer
    assert json.loads(body)["error"]["message"] == "the request headers did not arrive within server.read_timeout_s=1.0"


def test_trickled_body_gets_408(tight: str) -> None:
    sock = connect(tight)
    port = tight.rsplit(":", 1)[1]
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                 "Content-Length: 100\r\n\r\n{\"prompt\": ".encode())
    answer = read_all(sock)
    sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer
    assert json.loads(body)["error"]["message"] == ("the request body did not arrive within "
                                                    "server.read_timeout_s=1.0 (11 bytes came)")


def test_connections_past_the_limit_are_refused_clearly(tight: str) -> None:
    held = [connect(tight) for _ in range(3)]  # three idle connections: the limit
    try:
        time.sleep(0.2)  # (accepted by the server)
        resp, body = raw(tight, "POST", "/v1/completions", COMPLETION)
        assert resp.status == 503 and body["error"]["code"] == "too_many_connections", body
        assert "server.max_connections" in body["error"]["message"] and resp.getheader("Connection") == "close"
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    resp, body = raw(tight, "POST", "/v1/completions", COMPLETION)
    assert resp.status == 200, body


# ------------------------------------------------------------------ the context's edge, plugins failing

@pytest.mark.parametrize("route", ["completions", "chat"])
def test_prompt_of_max_model_len_refused_and_one_less_served(llm: LLM, url: str, client: Any, route: str) -> None:
    tok = llm.get_tokenizer()
    for length in (MAX_MODEL_LEN, MAX_MODEL_LEN - 1):
        if route == "completions":
            ids = [5 + i % 50 for i in range(length)]
            status, body = http(url + "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0,
                                                          "ignore_eos": True})
        else:  # single digits are single tokens; the template adds <|user|>, "\n" and <|assistant|>
            messages = [{"role": "user", "content": "7" * (length - 3)}]
            ids = tok_ids(llm, messages)
            assert len(ids) == length
            status, body = http(url + "/v1/chat/completions", {"messages": messages, "temperature": 0,
                                                               "ignore_eos": True})  # no max_tokens: what fits
        if length == MAX_MODEL_LEN:
            assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
            assert f"{MAX_MODEL_LEN} tokens" in body["error"]["message"]
        else:
            assert status == 200, body
            assert body["usage"] == {"prompt_tokens": length, "completion_tokens": 1, "total_tokens": MAX_MODEL_LEN}
            ref = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)[0]
            text = body["choices"][0]["text"] if route == "completions" else body["choices"][0]["message"]["content"]
            assert text == ref.outputs[0].text and body["choices"][0]["finish_reason"] == "length"
    assert_idle(llm, timeout=30)


@pytest.fixture
def faulty_registry(monkeypatch: pytest.MonkeyPatch) -> Any:
    import corerun.plugin.registry as registry_module
    from corerun.plugin.registry import Registry
    from tests.helpers import faulty_plugins

    reg = Registry.from_environment()
    reg.register_module(faulty_plugins, plugin="faulty", distribution=faulty_plugins.DISTRIBUTION, version="0")
    reg.register_module(_RaisingConstructor(), plugin="ctor", distribution="corerun-ctor", version="0")
    monkeypatch.setattr(registry_module, "_default", reg)
    return reg


class _RaisingConstructor:
    """A plugin whose attention backend raises in its constructor."""

    @hookimpl
    def corerun_attention_backends(self, register: Any) -> None:
        from corerun.attention.torch_backend import CAPABILITIES, TorchAttentionBackend

        class CtorRaises(TorchAttentionBackend):
            def __init__(self, spec: Any) -> None:
                raise RuntimeError("injected: the constructor fails")

        register("ctor_raises", CtorRaises, capabilities=CAPABILITIES, priority=-100,
                 description="raises in its constructor")


def test_plugin_raising_in_its_constructor_stops_serve_with_one_line(folder: Path, faulty_registry: Any) -> None:
    from click.testing import CliRunner

    from corerun.cli.serve import serve

    result = CliRunner().invoke(serve, ["--model", str(folder), "--device", "cpu", "--attention", "ctor_raises"])
    assert result.exit_code == 1
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: attention backend 'ctor_raises'") and "RuntimeError: injected: the constructor " \
        "fails" in last, result.output
    assert "Traceback" not in result.output


def test_plugin_raising_in_forward_under_the_server(folder: Path, faulty_registry: Any) -> None:
    """Forward calls 2 and 3 raise (the first request's second layer, the next request's first): both requests
    fail with an error their clients see (500 JSON, or an error event then [DONE]); the server serves on, exactly."""
    llm = make_llm(folder, **OVERRIDES, attention={"name": "faulty_attention", "options": {"fail_at": 2, "times": 2}})
    try:
        with running_server(llm) as u:
            status, body = http(u + "/v1/completions", {"prompt": "hi", "max_tokens": 4})
            assert status == 500 and body["error"]["code"] == "engine_error", body
            assert "injected" in body["error"]["message"] and "faulty_attention" in body["error"]["message"]
            resp, text = raw(u, "POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 4,
                                                                       "stream": True}).encode())
            events = [e for e in text.decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]" and "injected" in events[-2], events
            c = openai.OpenAI(base_url=u + "/v1", api_key="-", max_retries=0)
            r = c.completions.create(model="tiny-llama", prompt="hi", max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
            ids = llm.get_tokenizer().encode("hi")
            ref = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
            assert r.choices[0].text == ref.outputs[0].text and r.choices[0].finish_reason == "length"
            assert_idle(llm, timeout=30)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("stop, names", [(["x"] * 129, "128"), (["y" * 1025], "stop[0]")])
def test_stop_list_and_strings_are_bounded_with_a_400(url: str, stop: list[str], names: str) -> None:
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": stop}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                 "stop": stop})):
        resp, err = raw(url, "POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        assert resp.status == 400, (path, err)
        assert err["error"]["param"] == "stop" and names in err["error"]["message"], err
    resp, _ = raw(url, "POST", "/v1/completions", COMPLETION, {"Content-Type": "application/json"})
    assert resp.status == 200  # and the server goes on
