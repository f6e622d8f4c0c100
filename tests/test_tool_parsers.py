"""The built-in tool-call and reasoning parsers: the conformance suites (golden transcripts whole, split at
every point and in random chunkings), OpenAI's delta shape written out by hand, and the partial-JSON reader."""

from __future__ import annotations

import json
from typing import Any

import pytest

from corerun.conformance import run
from corerun.conformance.tool_parser_suite import ReasoningParserSuite, ToolParserSuite
from corerun.tool_parsers import ReasoningDelta, ToolCallDelta, ToolDelta, assemble
from corerun.tool_parsers.hermes import HermesToolParser
from corerun.tool_parsers.calls import CallReader, NotACall
from corerun.tool_parsers.json_scan import ValueScan, held_prefix
from corerun.tool_parsers.llama3_json import Llama3JsonToolParser
from corerun.tool_parsers.mistral import MistralToolParser
from corerun.tool_parsers.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from tests.broken_impls.tool_parser import (
    ArgumentsTwiceWhenStreamed, DropsLastCall, LosesContentBeforeCall, SharesOneStream,
)
from tests.test_conformance_rejects import _failed


class TestHermes(ToolParserSuite):
    factory = HermesToolParser


class TestLlama3Json(ToolParserSuite):
    factory = Llama3JsonToolParser


class TestMistral(ToolParserSuite):
    factory = MistralToolParser


class TestDeepSeekR1(ReasoningParserSuite):
    factory = DeepSeekR1ReasoningParser


class TestQwen3(ReasoningParserSuite):
    factory = Qwen3ReasoningParser


def test_hermes_stream_deltas_in_openai_shape() -> None:
    """The deltas of a call fed in four pieces, written out as OpenAI streams them."""
    s = HermesToolParser().stream()
    d1 = s.feed("Checking. <tool_c")
    d2 = s.feed('all>\n{"name": "get_weather", "argu')
    d3 = s.feed('ments": {"city": "Pa')
    d4 = s.feed('ris"}}\n</tool_call>')
    d5 = s.finish()
    assert (d1.content, d1.tool_calls) == ("Checking. ", [])
    (first,) = d2.tool_calls
    assert first.id.startswith("call_") and len(first.id) == 29
    assert first.to_openai() == {"index": 0, "id": first.id, "type": "function",
                                 "function": {"name": "get_weather", "arguments": ""}}
    assert [p.to_openai() for p in d3.tool_calls] == [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]
    assert [p.arguments for p in d4.tool_calls] == ['ris"}']
    assert not d5 and d4.content == "" and d2.content == ""


def test_assemble_refuses_deltas_out_of_shape() -> None:
    ok = [ToolDelta(tool_calls=[ToolCallDelta(0, "a", "f", "{")]), ToolDelta("x", [ToolCallDelta(0, arguments="}")])]
    got = assemble(ok)
    assert got.content == "x" and got.tool_calls[0].to_openai() == {
        "id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    with pytest.raises(ValueError, match="index 1 skips 0"):
        assemble([ToolDelta(tool_calls=[ToolCallDelta(1, "a", "f")])])
    with pytest.raises(ValueError, match="got an id or name again"):
        assemble([ToolDelta(tool_calls=[ToolCallDelta(0, "a", "f"), ToolCallDelta(0, "a", "f")])])
    with pytest.raises(ValueError, match="has no name"):
        assemble([ToolDelta(tool_calls=[ToolCallDelta(0, "a")])])


def test_a_call_cut_short_keeps_what_came() -> None:
    """max_tokens ends the answer inside a call: the call is kept with its arguments as far as they came."""
    got = HermesToolParser().parse('<tool_call>{"name": "f", "arguments": {"a": [1, 2')
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("f", '{"a": [1, 2')] and got.content == ""
    got = HermesToolParser().parse('<tool_call>{"na')  # no name yet: that text is content
    assert got.tool_calls == () and got.content == '<tool_call>{"na'


def test_mistral_ids_are_nine_letters_and_digits() -> None:
    got = MistralToolParser().parse('[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]')
    ids = [c.id for c in got.tool_calls]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and ids[0] != ids[1]


@pytest.mark.parametrize(
    ("text", "end"),
    [('{"a": "}"} tail', 10), ('[1, [2, "]"]]x', 13), ('"a\\"b" ', 6), ("12, 3", 2), ("true}", 4),
     ('"a\\\\" x', 5), ('{"a": "}', None), ("12", None), ('"\\', None)],
)
def test_value_scan_whole_and_split_at_every_point(text: str, end: int | None) -> None:
    """Where a value ends, fed whole and in two pieces at every split (a backslash, a quote, a bracket
    falling on either side): the same end."""
    scan = ValueScan()
    assert scan.feed(text) == end
    for k in range(1, len(text)):
        scan = ValueScan()
        got = scan.feed(text[:k])
        if got is None:
            rest = scan.feed(text[k:])
            got = None if rest is None else k + rest
        assert got == end, (k, text)
    with pytest.raises(ValueError, match="cannot start with ':'"):
        ValueScan().feed(": 1")


def test_call_reader_fields_in_any_order_and_cut_short() -> None:
    reader = CallReader(0, "id0")
    deltas, end = reader.feed('{"arguments": {"x": [1')  # the arguments before the name: held
    assert (deltas, end) == ([], None) and reader.text() == '{"arguments": {"x": [1'
    deltas, end = reader.feed('], "y": "}"}, "name": "f"} tail')
    assert [(d.name, d.arguments) for d in deltas] == [("f", ""), (None, '{"x": [1], "y": "}"}')]
    assert end == len('], "y": "}"}, "name": "f"}')
    reader = CallReader(1, "id1")
    deltas, _ = reader.feed('{"name": "g", "parameters": 12')
    assert [(d.name, d.arguments) for d in deltas] == [("g", ""), (None, "12")] and reader.finish() == []
    for not_a_call in ('{"n" 5}', '{"name": 5}', 'x', '{"arguments": {}}'):
        with pytest.raises(NotACall):
            reader = CallReader(0, "id")
            reader.feed(not_a_call)
            reader.finish()
        assert reader.text() == not_a_call
    assert held_prefix("abc <tool", "<tool_call>") == 5 and held_prefix("abc", "<tool_call>") == 0


@pytest.mark.parametrize(
    ("impl", "must_fail", "says"),
    [
        (DropsLastCall, {"whole"}, "calls ['get_weather'], the transcript means ['get_weather', 'get_time']"),
        (ArgumentsTwiceWhenStreamed, {"every_split", "chunkings", "fresh_streams"}, "which are not JSON"),
        (LosesContentBeforeCall, {"whole", "every_split"}, "the transcript means 'Let me check.\\n'"),
        (SharesOneStream, {"every_split", "chunkings", "fresh_streams"}, "tool call index 1 skips 0"),
    ],
    ids=["drops-last-call", "arguments-twice", "loses-content", "shares-one-stream"],
)
def test_broken_tool_parser_rejected(impl: type, must_fail: set[str], says: str) -> None:
    results = run("tool_parser", factory=impl)
    failed = _failed(results)
    assert must_fail <= set(failed), f"{impl.name}: expected {sorted(must_fail)} to fail, got {sorted(failed)}"
    reasons = [r.reason for check in must_fail for r in failed[check]]
    assert any(says in reason for reason in reasons), reasons[:3]
    assert all(r.id.startswith(f"tool_parser-{impl.name}-") for r in results)


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "deepseek_r1", "qwen3"])
def test_builtin_parsers_pass_through_the_runner(name: str) -> None:
    kind = "reasoning_parser" if name in ("deepseek_r1", "qwen3") else "tool_parser"
    results = run(kind, name)
    assert results and not _failed(results), [(r.id, r.reason) for r in results if r.failed]
    assert sum(r.outcome == "passed" for r in results) >= 9


def test_hook_corerun_tool_parsers() -> None:
    """A plugin object registering a parser through the hook is listed and built by name."""
    from corerun import hookimpl
    from corerun.plugin.registry import Registry

    class Plugin:
        @hookimpl
        def corerun_tool_parsers(self, register: Any) -> None:
            register("mine", HermesToolParser, capabilities=HermesToolParser.capabilities)

    reg = Registry.from_environment(allow=[])
    reg.register_module(Plugin(), plugin="mine", distribution="corerun-tool-parser-mine", version="0.1")
    assert {"hermes", "llama3_json", "mistral", "mine"} <= set(reg.names("tool_parser"))
    parser = reg.create("tool_parser", "mine")
    got = parser.parse('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [("f", {"a": 1})]
    assert reg.get("tool_parser", "mine").to_dict(False)["capabilities"]["formats"] == ["hermes"]


def test_hook_corerun_reasoning_parsers() -> None:
    from corerun import hookimpl
    from corerun.plugin.registry import Registry

    class Plugin:
        @hookimpl
        def corerun_reasoning_parsers(self, register: Any) -> None:
            register("mine", Qwen3ReasoningParser, capabilities=Qwen3ReasoningParser.capabilities)

    reg = Registry.from_environment(allow=[])
    reg.register_module(Plugin(), plugin="mine", distribution="corerun-reasoning-parser-mine", version="0.1")
    assert set(reg.names("reasoning_parser")) >= {"deepseek_r1", "qwen3", "mine"}
    assert reg.create("reasoning_parser", "mine").parse("<think>a</think>b") == ReasoningDelta("a", "b")


@pytest.mark.parametrize("kind", ["tool_parser", "reasoning_parser"])
def test_scaffolded_parser_passes_conformance_unedited(kind: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from corerun.scaffold import scaffold

    root = scaffold(kind, "fresh", tmp_path)
    monkeypatch.syspath_prepend(str(root))
    package = f"corerun_{kind}_fresh"
    plugin = __import__(f"{package}.plugin", fromlist=["CAPABILITIES"])
    parser = __import__(f"{package}.parser", fromlist=["Parser"])
    results = run(kind, factory=parser.Parser, capabilities=plugin.CAPABILITIES, name="fresh")
    assert sum(r.outcome == "passed" for r in results) >= 9 and not _failed(results), [
        (r.id, r.reason) for r in results if r.failed]
    assert "corerun serve --" in (root / "README.md").read_text()
    for module in [m for m in sys.modules if m.startswith(package)]:
        monkeypatch.delitem(sys.modules, module)
