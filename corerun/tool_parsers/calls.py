"""What the built-in parsers share: a call's deltas as its JSON grows, runs of call objects, and
``parse`` as one stream fed the whole text (so a whole answer and its stream cannot disagree)."""

from __future__ import annotations

import json
import secrets
import string
from typing import Any, Callable, ClassVar

from corerun.tool_parsers.json_scan import WHITESPACE, held_prefix, object_fields, skip, value_end
from corerun.tool_parsers.protocol import (
    ParsedTools, ToolCallDelta, ToolCallStream, ToolDelta, ToolParserCapabilities, Tools, assemble,
)

ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes and Mistral write "arguments", Llama 3 "parameters"


def openai_call_id() -> str:
    """``call_`` and 24 random hex digits, as OpenAI's ids look."""
    return "call_" + secrets.token_hex(12)


def mistral_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other ``tool_call_id``."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class CallBuilder:
    """One call's deltas as its text arrives: the id and name once, then the arguments' new characters."""

    def __init__(self, index: int, call_id: str) -> None:
        self.index = index
        self.id = call_id
        self.named = False
        self.sent = 0  # characters of the arguments already sent

    def name(self, name: str) -> ToolCallDelta:
        self.named = True
        return ToolCallDelta(self.index, id=self.id, name=name)

    def arguments(self, raw: str, complete: bool) -> ToolCallDelta | None:
        """The arguments' characters not sent yet; ``raw`` is their JSON value so far.  Arguments written as a
        JSON string holding JSON (``"{\\"city\\": ...}"``) are sent decoded, once the string is complete."""
        if raw.startswith('"'):
            if not complete:
                return None
            decoded = json.loads(raw)
            raw = decoded if isinstance(decoded, str) else raw
        new = raw[self.sent:]
        self.sent = len(raw)
        return ToolCallDelta(self.index, arguments=new) if new else None


def read_call_object(obj: str, complete: bool, call: CallBuilder) -> list[ToolCallDelta] | None:
    """The new deltas of the call object ``obj`` (``{"name": ..., "arguments": ...}`` so far; ``complete``:
    no more of it will come).  ``None``: it is not a call (no string ``name``, or not an object), and was
    not announced as one; its text is content."""
    out: list[ToolCallDelta] = []
    if not obj.strip():
        return None if complete else out
    try:
        fields, end = object_fields(obj, 0, final=complete)
    except ValueError:
        return out if call.named else None
    complete = complete or end is not None
    if not call.named:
        span = fields.get("name")
        if span is None or span[1] is None:
            return None if complete else out
        name = json.loads(obj[span[0]:span[1]])
        if not isinstance(name, str):
            return None
        out.append(call.name(name))
    span = next((fields[k] for k in ARGUMENT_KEYS if k in fields), None)
    if span is None:
        piece = call.arguments("{}", True) if complete else None
    else:
        start, stop = span
        piece = call.arguments(obj[start:] if stop is None else obj[start:stop], stop is not None)
    if piece is not None:
        out.append(piece)
    return out


class CallObjects:
    """A run of call objects (``{...};{...}`` or ``{...}, {...}]``), fed a buffer that grows.

    ``read(buf, final)`` returns the deltas, how much of ``buf`` it used up, and why it stopped:
    ``"more"`` (wait for text), ``"end"`` (``buf[used]`` is ``terminator``, not consumed), or
    ``"content"`` (the text from ``used`` on is not a call: the rest of the answer is content)."""

    def __init__(self, separators: str, terminator: str | None, new_id: Callable[[], str], first_index: int = 0) -> None:
        self.separators = WHITESPACE + separators
        self.terminator = terminator
        self.new_id = new_id
        self.index = first_index
        self.call: CallBuilder | None = None

    def read(self, buf: str, final: bool) -> tuple[list[ToolCallDelta], int, str]:
        out: list[ToolCallDelta] = []
        i = 0
        while True:
            i = skip(buf, i, self.separators)
            if i >= len(buf):
                return out, i, "more"
            if self.terminator is not None and buf[i] == self.terminator:
                return out, i, "end"
            if buf[i] != "{":
                return out, i, "content"
            end = value_end(buf, i, final)
            if self.call is None:
                self.call = CallBuilder(self.index, self.new_id())
            deltas = read_call_object(buf[i:] if end is None else buf[i:end], end is not None or final, self.call)
            if deltas is None:
                self.call = None
                return out, i, "content"
            out += deltas
            if end is None:
                if final:
                    self.index += 1
                    self.call = None
                    return out, len(buf), "more"
                return out, i, "more"
            self.index += 1
            self.call = None
            i = end


class BufferedStream:
    """A stream over a buffer that grows: ``feed`` appends and reads, ``finish`` reads once more, final."""

    def __init__(self) -> None:
        self.buf = ""

    def feed(self, text: str) -> Any:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> Any:
        return self._run(final=True)

    def _run(self, final: bool) -> Any:
        raise NotImplementedError

    def text_before(self, tag: str, final: bool) -> tuple[str, bool]:
        """The text before ``tag`` (taken from the buffer, which then starts past the tag) and True; or, when
        the tag is not there, the text but an end that may begin it, and False."""
        k = self.buf.find(tag)
        if k >= 0:
            text, self.buf = self.buf[:k], self.buf[k + len(tag):]
            return text, True
        keep = 0 if final else held_prefix(self.buf, tag)
        text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return text, False


class StreamingToolParser:
    """A base for parsers written as a stream: ``parse`` feeds the whole text to a fresh stream."""

    name: ClassVar[str]
    capabilities: ClassVar[ToolParserCapabilities]

    def __init__(self, **options: Any) -> None:
        if options:
            raise TypeError(f"tool-call parser '{self.name}' takes no options, got {sorted(options)}")

    def stream(self, tools: Tools = None) -> ToolCallStream:
        raise NotImplementedError

    def parse(self, text: str, tools: Tools = None) -> ParsedTools:
        s = self.stream(tools)
        return assemble([s.feed(text), s.finish()])

