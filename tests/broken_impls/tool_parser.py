"""Broken tool-call parsers, each the built-in ``hermes`` with one fault, that ``ToolParserSuite`` must reject."""

from __future__ import annotations

from typing import ClassVar

from corerun.tool_parsers import ParsedTools, ToolCallDelta, ToolDelta, assemble
from corerun.tool_parsers.hermes import HermesStream, HermesToolParser


class DropsLastCall(HermesToolParser):
    """``parse`` loses the last of several calls (streams are right)."""

    name: ClassVar[str] = "drops_last_call"

    def parse(self, text: str, tools: object = None) -> ParsedTools:
        got = super().parse(text, tools)
        return ParsedTools(got.content, got.tool_calls[:-1] if len(got.tool_calls) > 1 else got.tool_calls)


class _ArgumentsTwiceStream(HermesStream):
    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[int, str] = {}

    def _run(self, final: bool) -> ToolDelta:
        out = super()._run(final)
        for piece in out.tool_calls:
            self.sent[piece.index] = self.sent.get(piece.index, "") + piece.arguments
        if final:  # "flushes" what each call sent, once more
            out.tool_calls += [ToolCallDelta(i, arguments=a) for i, a in self.sent.items() if a]
        return out


class ArgumentsTwiceWhenStreamed(HermesToolParser):
    """A stream sends each call's arguments again when it finishes (``parse`` is right)."""

    name: ClassVar[str] = "arguments_twice"

    def stream(self, tools: object = None) -> HermesStream:
        return _ArgumentsTwiceStream()

    def parse(self, text: str, tools: object = None) -> ParsedTools:
        s = HermesStream()
        return assemble([s.feed(text), s.finish()])


class _LosesContentStream(HermesStream):
    def _run(self, final: bool) -> ToolDelta:
        out = super()._run(final)
        if out.tool_calls or self.call is not None:  # content that came with a call is dropped
            out.content = ""
        return out


class LosesContentBeforeCall(HermesToolParser):
    """Content in the same piece of text as a call (or while one is open) is dropped."""

    name: ClassVar[str] = "loses_content"

    def stream(self, tools: object = None) -> HermesStream:
        return _LosesContentStream()


class SharesOneStream(HermesToolParser):
    """Keeps one stream on the parser: a second answer continues the first one's state."""

    name: ClassVar[str] = "shares_one_stream"

    def stream(self, tools: object = None) -> HermesStream:
        if "_stream" not in self.__dict__:
            self._stream = HermesStream()
        return self._stream
