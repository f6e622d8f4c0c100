"""Llama 3.1-3.3 JSON calls: an answer that opens with a call object (after ``<|python_tag|>`` when the
detokenizer keeps it) is calls, several separated by ``;``; any other answer is content::

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

Text after the calls is content.  An answer that opens with an object that is no call (no ``name``)
is content as a whole.
"""

from __future__ import annotations

from typing import ClassVar

from corerun.tool_parsers.calls import BufferedStream, CallObjects, StreamingToolParser, openai_call_id
from corerun.tool_parsers.protocol import ToolDelta, ToolParserCapabilities, Tools

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonStream(BufferedStream):
    def __init__(self) -> None:
        super().__init__()
        self.state = "start"  # start -> calls -> content, or start -> content
        self.calls = CallObjects(";", None, openai_call_id)

    def _run(self, final: bool) -> ToolDelta:
        out = ToolDelta()
        if self.state == "start":
            head = self.buf.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                if not final:
                    return out
            if head.startswith(PYTHON_TAG):
                self.buf, self.state = head[len(PYTHON_TAG):], "calls"
            elif head.startswith("{"):
                self.buf, self.state = head, "calls"
            else:
                self.state = "content"
        if self.state == "calls":  # the calls' text goes to their reader as it arrives
            deltas, rest = self.calls.feed(self.buf, final)
            out.tool_calls += deltas
            self.buf = rest or ""
            if rest is not None:
                self.state = "content"
        if self.state == "content":
            out.content += self.buf
            self.buf = ""
        return out


class Llama3JsonToolParser(StreamingToolParser):
    name: ClassVar[str] = "llama3_json"
    capabilities: ClassVar[ToolParserCapabilities] = ToolParserCapabilities(
        formats=frozenset({"llama3_json"}), template_markers=(PYTHON_TAG,))

    def stream(self, tools: Tools = None) -> Llama3JsonStream:
        return Llama3JsonStream()
