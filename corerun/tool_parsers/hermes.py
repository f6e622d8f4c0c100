"""Hermes and Qwen: each call a JSON object between ``<tool_call>`` and ``</tool_call>``, text around them::

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

from typing import ClassVar

from corerun.tool_parsers.calls import BufferedStream, CallReader, NotACall, StreamingToolParser, openai_call_id
from corerun.tool_parsers.protocol import ToolDelta, ToolParserCapabilities, Tools

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesStream(BufferedStream):
    """The buffer holds only what may begin a tag; a call's text goes to its reader as it arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.index = 0
        self.call: CallReader | None = None  # inside <tool_call> ... </tool_call>

    def _run(self, final: bool) -> ToolDelta:
        out = ToolDelta()
        while True:
            if self.call is None:
                text, opened = self.text_before(OPEN, final)
                out.content += text
                if not opened:
                    return out
                self.call = CallReader(self.index, openai_call_id())
                continue
            body, closed = self.text_before(CLOSE, final)
            try:
                out.tool_calls += self.call.feed(body)[0]
                if closed or final:
                    out.tool_calls += self.call.finish()
            except NotACall:  # not a call after all: the tag and its text are content
                out.content += OPEN + self.call.text() + (CLOSE if closed else self.buf)
                self.buf = self.buf if closed else ""
                self.call = None
                continue
            if not (closed or final):
                return out
            self.index += 1
            self.call = None
            if not closed:
                return out


class HermesToolParser(StreamingToolParser):
    name: ClassVar[str] = "hermes"
    capabilities: ClassVar[ToolParserCapabilities] = ToolParserCapabilities(
        formats=frozenset({"hermes"}), template_markers=(OPEN,))

    def stream(self, tools: Tools = None) -> HermesStream:
        return HermesStream()
