"""Mistral: calls after ``[TOOL_CALLS]``, as a JSON list (tokenizer v3 and before) or as ``name[ARGS]{...}``
(v11 on, one ``[TOOL_CALLS]`` per call); text before them is content::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

``[TOOL_CALLS]`` is a control token: it reaches this parser only where the detokenizer keeps it.
"""

from __future__ import annotations

from typing import ClassVar

from corerun.tool_parsers.calls import BufferedStream, CallBuilder, CallObjects, StreamingToolParser, mistral_call_id
from corerun.tool_parsers.json_scan import skip, value_end
from corerun.tool_parsers.protocol import ToolDelta, ToolParserCapabilities, Tools

TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralStream(BufferedStream):
    def __init__(self) -> None:
        super().__init__()
        self.state = "content"  # content -> tag -> (list | name -> args) -> content
        self.index = 0
        self.list: CallObjects | None = None
        self.call: CallBuilder | None = None

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
            elif self.state == "list":
                assert self.list is not None
                deltas, used, why = self.list.read(self.buf, final)
                out.tool_calls += deltas
                self.index = self.list.index
                self.buf = self.buf[used:]
                if why == "more":
                    return out
                if why == "end":
                    self.buf = self.buf[1:]
                self.state = "content"
            elif self.state == "name":
                k = self.buf.find(ARGS)
                if k < 0:
                    if final:
                        out.content += TAG + self.buf
                        self.buf = ""
                    return out
                self.call = CallBuilder(self.index, mistral_call_id())
                out.tool_calls.append(self.call.name(self.buf[:k].strip()))
                self.buf, self.state = self.buf[k + len(ARGS):], "args"
            else:  # args: one JSON value
                assert self.call is not None
                i = skip(self.buf, 0)
                if i >= len(self.buf):
                    if final:
                        self._end_call(out, "{}")
                    return out
                try:
                    end = value_end(self.buf, i, final)
                except ValueError:  # no JSON here: the call has no arguments, the rest is content
                    self._end_call(out, "{}")
                    self.buf = self.buf[i:]
                    continue
                piece = self.call.arguments(self.buf[i:] if end is None else self.buf[i:end], end is not None)
                if piece is not None:
                    out.tool_calls.append(piece)
                if end is None and not final:
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
        self.call, self.state = None, "content"


class MistralToolParser(StreamingToolParser):
    name: ClassVar[str] = "mistral"
    capabilities: ClassVar[ToolParserCapabilities] = ToolParserCapabilities(
        formats=frozenset({"mistral"}), template_markers=(TAG,))

    def stream(self, tools: Tools = None) -> MistralStream:
        return MistralStream()
