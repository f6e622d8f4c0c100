"""Tool calling and reasoning output through ``corerun serve``, driven by the ``openai`` client, on a tiny
random Llama whose chat template writes and reads Hermes calls (``<tool_call>{json}</tool_call>``).

A random model calls no tool of its own accord, so each answer is either enforced by the server
(``required`` and named ``tool_choice``: the arguments must parse and validate under the tool's schema
whatever the model) or steered by a regular expression the request sends (``auto``, reasoning), whose
text is then known; the reference for the prompt is transformers' ``apply_chat_template``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from corerun import LLM  # noqa: E402
from corerun.server import protocol as P  # noqa: E402
from corerun.server.tool_calls import ChatParsers, plan  # noqa: E402
from tests.helpers.engine_testing import no_hang  # noqa: E402,F401
from tests.helpers.serving import ENGINE, running_server  # noqa: E402
from tests.helpers.tiny_models import make_tiny_model  # noqa: E402
from tests.helpers.tiny_tokenizer import add_tiny_tokenizer  # noqa: E402

TOOLS_TEMPLATE = (
    "{%- if tools %}<|user|>Tools:\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}<|user|>{{ m['content'] }}\n"
    "{%- elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] or '' }}"
    "{%- for call in m['tool_calls'] or [] %}<tool_call>{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}</tool_call>{%- endfor %}\n"
    "{%- elif m['role'] == 'tool' %}<|user|><tool_response>{{ m['content'] }}</tool_response>\n"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                         "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "weather in Paris?"}]


def tools_model(tmp: Path) -> Path:
    """A tiny random Llama (2,048 positions: a prompt with tools is long in one-character tokens) whose chat
    template shows the tools and renders calls and results as Hermes does."""
    folder = add_tiny_tokenizer(make_tiny_model(tmp, "llama", max_position_embeddings=2048))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    folder = tools_model(tmp_path_factory.mktemp("tools"))
    llm = LLM(str(folder), **ENGINE, kv_cache={"num_blocks": 256, "block_size": 8},
              scheduler={"max_model_len": 1024}, server={"reasoning_parser": "qwen3"})
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def client(llm: LLM) -> Iterator[Any]:
    with running_server(llm) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)


def _valid(call: Any) -> dict[str, Any]:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def _streamed(client: Any, **kw: Any) -> tuple[dict[str, Any], str | None]:
    """The stream's deltas put back together as a client does: content, reasoning, calls by index."""
    content, reasoning, calls, reasons = [], [], {}, []
    for chunk in client.chat.completions.create(model="tiny-llama", stream=True, **kw):
        d = chunk.choices[0].delta
        content.append(d.content or "")
        reasoning.append(getattr(d, "reasoning_content", None) or "")
        for piece in d.tool_calls or ():
            if piece.index not in calls:
                assert piece.id and piece.function.name, piece  # the first delta of a call names it
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            else:
                assert piece.id is None and piece.function.name is None, piece
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert sorted(calls) == list(range(len(calls)))
    return {"content": "".join(content), "reasoning": "".join(reasoning), "calls": [calls[i] for i in sorted(calls)]}, reasons[-1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_named_function_arguments_always_parse(client: Any, seed: int) -> None:
    r = client.chat.completions.create(model="tiny-llama", messages=ASK, tools=TOOLS, max_tokens=200, seed=seed,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_") and call.type == "function"
    args = _valid(call)
    assert set(args) == {"city", "unit"}
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    streamed, reason = _streamed(client, messages=ASK, tools=TOOLS, max_tokens=200, seed=seed, temperature=0,
                                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(model="tiny-llama", messages=ASK, tools=TOOLS, max_tokens=200, seed=seed,
                                           temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert reason == "tool_calls" and [c["name"] for c in streamed["calls"]] == ["get_weather"]
    assert streamed["calls"][0]["arguments"] == whole.choices[0].message.tool_calls[0].function.arguments


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_parse_and_validate(client: Any, parallel: bool) -> None:
    reasons = []
    for seed in range(3):
        r = client.chat.completions.create(model="tiny-llama", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=parallel, max_tokens=400, seed=seed)
        calls, reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        reasons.append(reason)
        assert calls and (parallel or len(calls) == 1) and reason in ("tool_calls", "length")
        assert len({c.id for c in calls}) == len(calls)
        for call in calls if reason == "tool_calls" else calls[:-1]:  # max_tokens may cut the list's last call
            _valid(call)
    assert reasons.count("tool_calls") >= 2, reasons  # a random model may go on listing calls (seed 2 does)
    streamed, reason = _streamed(client, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
                                 max_tokens=400, seed=0)
    whole = client.chat.completions.create(model="tiny-llama", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=parallel, max_tokens=400, seed=0)
    assert reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]


@pytest.mark.timeout(300)
def test_auto_reads_the_models_hermes_call(client: Any) -> None:
    """The answer is steered (a regex) to text with a Hermes call: ``auto`` returns the call and the text before it."""
    steer = {"structured_outputs": {"regex": r'Sure\.<tool_call>\{"name": "get_weather", "arguments": '
                                             r'\{"city": "[a-z]{2,5}", "unit": "c"\}\}</tool_call>'}}
    r = client.chat.completions.create(model="tiny-llama", messages=ASK, tools=TOOLS, max_tokens=200, seed=3,
                                       temperature=0, extra_body=steer)
    msg = r.choices[0].message
    (call,) = msg.tool_calls
    assert msg.content == "Sure." and call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    args = _valid(call)
    assert re.fullmatch("[a-z]{2,5}", args["city"]) and args["unit"] == "c"
    streamed, reason = _streamed(client, messages=ASK, tools=TOOLS, max_tokens=200, seed=3, temperature=0,
                                 extra_body=steer)
    assert reason == "tool_calls" and streamed["content"] == "Sure."
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"]] == [("get_weather", args)]
    # tool_choice none: the same text stays content
    r = client.chat.completions.create(model="tiny-llama", messages=ASK, tools=TOOLS, tool_choice="none",
                                       max_tokens=200, seed=3, temperature=0, extra_body=steer)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content.startswith("Sure.<tool_call>")
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.timeout(300)
def test_tool_result_fed_back_renders_as_transformers_does(llm: LLM, client: Any) -> None:
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    r = client.chat.completions.create(model="tiny-llama", messages=history, tools=TOOLS, max_tokens=4)
    tok = llm.get_tokenizer()
    for_hf = [dict(m) for m in history]
    for_hf[1] = {**for_hf[1], "content": "", "tool_calls": [{**for_hf[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]}
    text = tok.apply_chat_template(for_hf, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>' in text
    assert "<tool_response>21 degrees</tool_response>" in text
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


@pytest.mark.timeout(300)
def test_reasoning_content_whole_and_streamed(client: Any) -> None:
    steer = {"structured_outputs": {"regex": r"<think>[a-z]{3,8}</think>[a-z]{2,5}"}}
    r = client.chat.completions.create(model="tiny-llama", messages=ASK, max_tokens=40, temperature=0, extra_body=steer)
    msg = r.choices[0].message
    assert re.fullmatch("[a-z]{3,8}", msg.reasoning_content) and re.fullmatch("[a-z]{2,5}", msg.content)
    streamed, _ = _streamed(client, messages=ASK, max_tokens=40, temperature=0, extra_body=steer)
    assert (streamed["reasoning"], streamed["content"]) == (msg.reasoning_content, msg.content)


def test_tool_requests_refused_with_the_field() -> None:
    def req(**kw: Any) -> P.ChatCompletionRequest:
        return P.ChatCompletionRequest(messages=ASK, **kw)

    cases = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice.function.name: 'nope' is not among the tools (get_weather, get_time)"),
        (dict(tool_choice="required"), 'tool_choice: "required" needs tools; the request has none'),
        (dict(tools=TOOLS, tool_choice="always"), "tool_choice: must be 'none', 'auto', 'required' or"),
        (dict(tools=[{"type": "function", "function": {"name": ""}}]), "tools.0.function.name: must be a non-empty string"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
         "tool_choice: required constrains the output to the tool's arguments, so it cannot be combined with response_format"),
        (dict(tools=TOOLS), "tool_choice: 'auto' needs a tool-call parser, and this server has none"),
    ]
    for fields, message in cases:
        with pytest.raises(P.APIError) as info:
            plan(req(**fields), ChatParsers())
        assert info.value.status == 400 and message in info.value.message, info.value.message
    got = plan(req(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), ChatParsers())
    assert got.schema == {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": SCHEMAS[name]},
         "required": ["name", "parameters"], "additionalProperties": False} for name in ("get_weather", "get_time")]}}
    assert plan(req(), ChatParsers()) is None  # no tools, no reasoning parser: the answer is served as before


def test_auto_tool_parser_from_the_chat_template() -> None:
    from types import SimpleNamespace

    from corerun.server.tool_calls import choose_parsers

    def chosen(template: Any, **cfg: Any) -> tuple[str | None, str | None]:
        got = choose_parsers(SimpleNamespace(**cfg), SimpleNamespace(chat_template=template))
        return got.tool_name, got.reasoning_name

    assert chosen("{{ '<tool_call>' }}{{ '<think>' }}", tool_call_parser="auto") == ("hermes", None)
    assert chosen({"default": "x", "tool_use": "<|python_tag|>"}, tool_call_parser="auto") == ("llama3_json", None)
    assert chosen("[TOOL_CALLS] <tool_call>", tool_call_parser="auto") == (None, None)  # two formats: none chosen
    assert chosen("plain", tool_call_parser="auto", reasoning_parser="deepseek_r1") == (None, "deepseek_r1")
    assert chosen("<tool_call>", tool_call_parser="none") == (None, None)
    assert chosen("plain", tool_call_parser="mistral") == ("mistral", None)


def test_choice_output_whole_and_deltas_with_thinking_and_two_calls() -> None:
    """Thinking, then content, then two Hermes calls with a newline between them: the whole message and
    the deltas fed one character at a time say the same."""
    from corerun.server.tool_calls import ToolPlan, choose_parsers
    from types import SimpleNamespace

    parsers = choose_parsers(SimpleNamespace(tool_call_parser="hermes", reasoning_parser="qwen3"), None)
    text = ('<think>use tools</think>Checking.<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>')
    whole = ToolPlan("auto", tools=TOOLS, parsers=parsers).output()
    msg = whole.message(text)
    assert msg["reasoning_content"] == "use tools" and msg["content"] == "Checking.\n"  # the text between the calls too
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_time", {}), ("get_weather", {"city": "Oslo", "unit": "c"})]
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"
    streamed = ToolPlan("auto", tools=TOOLS, parsers=parsers).output()
    deltas = [streamed.delta(ch, i == len(text) - 1) for i, ch in enumerate(text)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "use tools"
    assert "".join(d.get("content", "") for d in deltas) == "Checking.\n"
    args = {}
    for d in deltas:
        for piece in d.get("tool_calls", ()):
            args[piece["index"]] = args.get(piece["index"], "") + piece["function"]["arguments"]
    assert [json.loads(args[i]) for i in (0, 1)] == [{}, {"city": "Oslo", "unit": "c"}]
    single = ToolPlan("auto", tools=TOOLS, parallel=False, parsers=parsers).output().message(text)
    assert [c["function"]["name"] for c in single["tool_calls"]] == ["get_time"]  # parallel_tool_calls: false


@pytest.mark.timeout(300)
def test_corerun_serve_command_with_parser_options(tmp_path: Path) -> None:
    """``corerun serve --tool-call-parser hermes --reasoning-parser deepseek_r1`` in its own process."""
    from tests.test_server_cli import _wait_healthy, start_serve

    folder = tools_model(tmp_path)
    cmd = [sys.executable, "-m", "corerun", "serve", "--model", str(folder), "--port", "0", "--device", "cpu",
           "--dtype", "float32", "--attention", "torch", "--served-model-name", "tiny", "--set", "kv_cache.num_blocks=128",
           "--set", "scheduler.max_model_len=1024", "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1"]
    proc, url, _ = start_serve(cmd)
    try:
        _wait_healthy(url, proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200, seed=1,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        _valid(r.choices[0].message.tool_calls[0])
        steer = {"structured_outputs": {"regex": r'[a-z]{3}</think>Ok<tool_call>\{"name": "get_time", "arguments": \{\}\}</tool_call>'}}
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                                           extra_body=steer)
        msg = r.choices[0].message
        assert re.fullmatch("[a-z]{3}", msg.reasoning_content) and msg.content == "Ok"
        assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [("get_time", "{}")]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
