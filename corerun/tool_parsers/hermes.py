"""Hermes and Qwen: each call a JSON object between ``<tool_call>`` and ``</tool_call>``, text around them::

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

from typing import ClassVar

from corerun.tool_parsers.calls import BufferedStream, CallBuilder, StreamingToolParser, openai_call_id, read_call_object
from corerun.tool_parsers.json_scan import held_prefix
from corerun.tool_parsers.protocol import ToolDelta, ToolParserCapabilities, Tools

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesStream(BufferedStream):
    def __init__(self) -> None:
        super().__init__()
        self.index = 0
        self.call: CallBuilder | None = None  # inside <tool_call> ... </tool_call>

    def _run(self, final: bool) -> ToolDelta:
        out = ToolDelta()
        while True:
            if self.call is None:
                text, opened = self.text_before(OPEN, final)
                out.content += text
                if not opened:
                    return out
                self.call = CallBuilder(self.index, openai_call_id())
                continue
            k = self.buf.find(CLOSE)
            closed = k >= 0
            if closed:
                body, rest = self.buf[:k], self.buf[k + len(CLOSE):]
            else:
                body, rest = self.buf[:len(self.buf) - (0 if final else held_prefix(self.buf, CLOSE))], ""
            deltas = read_call_object(body.strip(), closed or final, self.call)
            if deltas is None:  # not a call after all: the tag and its text are content
                out.content += OPEN + (self.buf[:k + len(CLOSE)] if closed else self.buf)
                self.buf, self.call = rest, None
                continue
            out.tool_calls += deltas
            if not (closed or final):
                return out
            self.index += 1
            self.buf, self.call = rest, None
            if not closed:
                return out


class HermesToolParser(StreamingToolParser):
    name: ClassVar[str] = "hermes"
    capabilities: ClassVar[ToolParserCapabilities] = ToolParserCapabilities(
        formats=frozenset({"hermes"}), template_markers=(OPEN,))

    def stream(self, tools: Tools = None) -> HermesStream:
        return HermesStream()
