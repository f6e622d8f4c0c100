"""The built-in tool-call and reasoning parsers: the conformance suites (golden transcripts whole, split at
every point and in random chunkings), OpenAI's delta shape written out by hand, and the partial-JSON reader."""

from __future__ import annotations

import json

import pytest

from corerun.conformance.tool_parser_suite import ReasoningParserSuite, ToolParserSuite
from corerun.tool_parsers import ToolCallDelta, ToolDelta, assemble
from corerun.tool_parsers.hermes import HermesToolParser
from corerun.tool_parsers.json_scan import held_prefix, object_fields, value_end
from corerun.tool_parsers.llama3_json import Llama3JsonToolParser
from corerun.tool_parsers.mistral import MistralToolParser
from corerun.tool_parsers.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser


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
    ("text", "start", "end"),
    [('{"a": "}"} tail', 0, 10), ('[1, [2, "]"]]x', 0, 13), ('"a\\"b" ', 0, 6), ("12, 3", 0, 2), ("true}", 0, 4),
     ('{"a": "}', 0, None), ("12", 0, None), ('"\\', 0, None)],
)
def test_value_end(text: str, start: int, end: int | None) -> None:
    assert value_end(text, start) == end


def test_object_fields_so_far() -> None:
    text = '{"name": "f", "arguments": {"x": [1'
    fields, end = object_fields(text, 0)
    assert end is None and fields == {"name": (9, 12), "arguments": (27, None)}
    assert json.loads(text[9:12]) == "f"
    fields, end = object_fields('{"n": 5}', 0)
    assert (fields, end) == ({"n": (6, 7)}, 8)
    with pytest.raises(ValueError, match="expected ':'"):
        object_fields('{"n" 5}', 0)
    assert held_prefix("abc <tool", "<tool_call>") == 5 and held_prefix("abc", "<tool_call>") == 0
