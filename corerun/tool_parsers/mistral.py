"""Mistral: calls after ``[TOOL_CALLS]``, as a JSON list (tokenizer v3 and before) or as ``name[ARGS]{...}``
(v11 on, one ``[TOOL_CALLS]`` per call); text before them is content::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

``[TOOL_CALLS]`` is a control token: it reaches this parser only where the detokenizer keeps it.
"""

from __future__ import annotations

from typing import ClassVar

from corerun.tool_parsers.calls import BufferedStream, CallBuilder, CallObjects, StreamingToolParser, mistral_call_id
from corerun.tool_parsers.json_scan import ValueScan, skip
from corerun.tool_parsers.protocol import ToolDelta, ToolParserCapabilities, Tools

TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralStream(BufferedStream):
    def __init__(self) -> None:
        super().__init__()
        self.state = "content"  # content -> tag -> (list | name -> args) -> content
        self.index = 0
        self.list: CallObjects | None = None
        self.call: CallBuilder | None = None
        self.value: ValueScan | None = None  # where the arguments' value ends
        self.searched = 0  # how much of the buffer is known to hold no [ARGS]

    def _run(self, final: bool) -> ToolDelta:
        out = ToolDelta()
        while True:
            if self.state == "content":
                text, tagged = self.text_before(TAG, final)
                out.content += text
                if not tagged:
                    return out
                self.state = "tag"
            elif self.state == "tag":
                i = skip(self.buf, 0)
                if i >= len(self.buf):
                    if final:
                        out.content += TAG + self.buf
                        self.buf = ""
                    return out
                if self.buf[i] == "[":
                    self.list = CallObjects(",", "]", mistral_call_id, self.index)
                    self.buf, self.state = self.buf[i + 1:], "list"
                else:
                    self.state = "name"
            elif self.state == "list":  # the calls' text goes to their reader as it arrives
                assert self.list is not None
                deltas, rest = self.list.feed(self.buf, final)
                out.tool_calls += deltas
                self.index = self.list.index
                if rest is None:
                    self.buf = ""
                    return out
                self.buf = rest[1:] if rest.startswith("]") else rest
                self.state = "content"
            elif self.state == "name":
                k = self.buf.find(ARGS, self.searched)
                if k < 0:
                    if final:
                        out.content += TAG + self.buf
                        self.buf = ""
                    self.searched = max(0, len(self.buf) - len(ARGS) + 1)
                    return out
                self.call = CallBuilder(self.index, mistral_call_id())
                out.tool_calls.append(self.call.name(self.buf[:k].strip()))
                self.buf, self.state, self.searched = self.buf[k + len(ARGS):], "args", 0
            else:  # args: one JSON value, its text sent on as it arrives
                assert self.call is not None
                i = 0
                if self.value is None:
                    i = skip(self.buf, 0)
                    if i >= len(self.buf):
                        self.buf = ""
                        if final:
                            self._end_call(out, "{}")
                        return out
                    self.value = ValueScan()
                try:
                    end = self.value.feed(self.buf, i)
                except ValueError:  # no JSON here: the call has no arguments, the rest is content
                    self._end_call(out, "{}")
                    self.buf = self.buf[i:]
                    continue
                done = end is not None or (final and self.value.scalar)
                piece = self.call.arguments(self.buf[i:] if end is None else self.buf[i:end], done)
                if piece is not None:
                    out.tool_calls.append(piece)
                if end is None and not final:
                    self.buf = ""
                    return out
                self._end_call(out, None)
                self.buf = "" if end is None else self.buf[end:]

    def _end_call(self, out: ToolDelta, arguments: str | None) -> None:
        assert self.call is not None
        if arguments is not None:
            piece = self.call.arguments(arguments, True)
            if piece is not None:
                out.tool_calls.append(piece)
        self.index += 1
        self.call, self.value, self.state = None, None, "content"


class MistralToolParser(StreamingToolParser):
    name: ClassVar[str] = "mistral"
    capabilities: ClassVar[ToolParserCapabilities] = ToolParserCapabilities(
        formats=frozenset({"mistral"}), template_markers=(TAG,))

    def stream(self, tools: Tools = None) -> MistralStream:
        return MistralStream()
