"""Streaming a call costs work in its length: a long arguments value fed one character at a time makes
every parser (and the server's required / named streams) run a number of Python lines that grows as the
value does, not as its square, and the text a stream holds stays bounded once the call is named.

Work is counted, not timed: the lines run under ``sys.settrace`` for arguments of n and 2n characters;
reading the text so far again at every character (as a re-scan does) makes the count four times larger."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

import pytest

from corerun.server.tool_calls import ChatParsers, ToolPlan
from corerun.tool_parsers import assemble
from corerun.tool_parsers.hermes import HermesToolParser
from corerun.tool_parsers.llama3_json import Llama3JsonToolParser
from corerun.tool_parsers.mistral import MistralToolParser

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def arguments(n: int) -> str:
    """Arguments of about ``n`` characters: a string with escapes and brackets in it, a nested list."""
    k = n // 16
    return json.dumps({"q": 'a "b" {c} [d]\\ ' * (k // 2), "n": [[i, [i]] for i in range(k // 2)]})


# (how the model writes one call to search with these arguments, the stream)
FORMATS: dict[str, tuple[Callable[[str], str], Callable[[], Any]]] = {
    "hermes": (lambda a: f'Sure.<tool_call>\n{{"name": "search", "arguments": {a}}}\n</tool_call>',
               lambda: HermesToolParser().stream()),
    "llama3_json": (lambda a: f'{{"name": "search", "parameters": {a}}}', lambda: Llama3JsonToolParser().stream()),
    "mistral-list": (lambda a: f'[TOOL_CALLS][{{"name": "search", "arguments": {a}}}]', lambda: MistralToolParser().stream()),
    "mistral-args": (lambda a: f"[TOOL_CALLS]search[ARGS]{a}", lambda: MistralToolParser().stream()),
    "required": (lambda a: f'[{{"name": "search", "parameters": {a}}}]',
                 lambda: ToolPlan("required", tools=TOOLS, parsers=ChatParsers()).output().tools),
    "named": (lambda a: a, lambda: ToolPlan("named", tools=TOOLS, function="search", parsers=ChatParsers()).output().tools),
}


def streamed(fmt: str, n: int) -> tuple[int, int, str]:
    """Lines run to stream the call one character at a time, the most text the stream kept after the
    call's name, and the arguments the deltas put back together."""
    write, make = FORMATS[fmt]
    text, stream = write(arguments(n)), make()
    lines, held, deltas = 0, 0, []

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal lines
        lines += event == "line"
        return trace

    sys.settrace(trace)
    try:
        for ch in text:
            deltas.append(stream.feed(ch))
            if any(d.tool_calls for d in deltas):  # the text the stream keeps in its own attributes
                held = max(held, sum(len(v) for v in vars(stream).values() if isinstance(v, str)))
        deltas.append(stream.finish())
    finally:
        sys.settrace(None)
    (call,) = assemble(deltas).tool_calls
    assert call.name == "search"
    return lines, held, call.arguments


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_streaming_a_long_call_is_linear(fmt: str) -> None:
    small, held_small, args_small = streamed(fmt, 600)
    large, held_large, args_large = streamed(fmt, 1200)
    assert (args_small, args_large) == (arguments(600), arguments(1200))  # char for char, as written
    assert large / small < 2.3, (small, large)  # linear: about 2; a re-scan per character: about 4
    assert max(held_small, held_large) <= len("</tool_call>")  # a possible closing tag at most, not the call
