"""What the built-in parsers share: a call's deltas as its JSON arrives (:class:`CallReader`, each
character read once), runs of call objects, and ``parse`` as one stream fed the whole text (so a whole
answer and its stream cannot disagree)."""

from __future__ import annotations

import json
import secrets
import string
from typing import Any, Callable, ClassVar

from corerun.tool_parsers.json_scan import WHITESPACE, ValueScan, held_prefix, skip
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
    """One call's deltas as its text arrives: the id and name once, then the arguments' characters."""

    def __init__(self, index: int, call_id: str) -> None:
        self.index = index
        self.id = call_id
        self.named = False
        self.started = False  # the arguments' first character has come
        self.quoted: list[str] | None = None  # arguments written as a JSON string: its pieces, held

    def name(self, name: str) -> ToolCallDelta:
        self.named = True
        return ToolCallDelta(self.index, id=self.id, name=name)

    def arguments(self, piece: str, end: bool) -> ToolCallDelta | None:
        """The next characters of the arguments' JSON value (``end``: the value is complete).  Arguments
        written as a JSON string holding JSON (``"{\\"city\\": ...}"``) are sent decoded, once complete."""
        if piece and not self.started:
            self.started = True
            self.quoted = [] if piece[0] == '"' else None
        if self.quoted is not None:
            self.quoted.append(piece)
            if not end:
                return None
            raw, self.quoted = "".join(self.quoted), None
            try:
                decoded = json.loads(raw)
            except ValueError:
                decoded = None
            piece = decoded if isinstance(decoded, str) else raw
        return ToolCallDelta(self.index, arguments=piece) if piece else None


class NotACall(Exception):
    """The text read so far cannot be a call (not an object, no string ``name``): it is content."""


class CallReader:
    """One call object ``{"name": ..., "arguments": ...}`` read as its text arrives, each character once.

    ``feed(text)`` returns the new deltas and the index in ``text`` just past the object (None while it
    goes on; text fed after the object is ignored); ``finish()`` the last ones when no more will come.
    The name is sent once complete, then the arguments (``arguments`` or ``parameters``) as they arrive;
    arguments written before the name wait for it.  Until the name is read everything fed is kept
    (``text()``) and ``NotACall`` is raised when it cannot be a call.  After the name, JSON that breaks
    ends the call where its brackets close.
    """

    def __init__(self, index: int, call_id: str) -> None:
        self.call = CallBuilder(index, call_id)
        self.state = "open"  # open, key, key_text, colon, value, in_value, after, skip, done
        self.held: list[str] | None = []  # everything fed, until the name is read
        self.scan: ValueScan | None = None  # in a key, a value, or (skip) the rest of a broken object
        self.field: str | None = None  # the key whose value is being read
        self.pieces: list[str] = []  # the text of the key, or of the name, being read
        self.args: str | None = None  # the key the arguments came under, once their value began
        self.args_held: list[str] = []  # their text while the name has not come
        self.args_done = False

    def text(self) -> str:
        return "".join(self.held or ())

    def feed(self, text: str) -> tuple[list[ToolCallDelta], int | None]:
        if self.held is not None:
            self.held.append(text)
        out: list[ToolCallDelta] = []
        i, n = 0, len(text)
        while i < n and self.state != "done":
            if self.scan is None:
                i = skip(text, i)
                if i < n:
                    i = self._structure(text[i], i, out)
                continue
            try:
                end = self.scan.feed(text, i)
            except ValueError:  # no JSON value starts here
                self._broken(i)
                continue
            self._piece(text[i:n if end is None else end], end is not None, out)
            i = n if end is None else end
        return out, (i if self.state == "done" else None)

    def finish(self) -> list[ToolCallDelta]:
        if self.state == "done":
            return []
        out: list[ToolCallDelta] = []
        if self.state == "in_value" and self.scan is not None and self.scan.scalar:
            self._piece("", True, out)  # a number or literal reaching the end of the answer is complete
        self._end(out)
        return out

    def _structure(self, c: str, i: int, out: list[ToolCallDelta]) -> int:
        """Read the character ``c`` at ``i``, outside any key or value; the index to go on from."""
        state = self.state
        if state == "open" and c == "{":
            self.state = "key"
        elif state == "key" and c == '"':
            self.state, self.scan, self.pieces = "key_text", ValueScan(), []
            return i
        elif state in ("key", "after") and c == "}":
            self._end(out)
        elif state == "colon" and c == ":":
            self.state = "value"
        elif state == "value":
            self.state, self.scan, self.pieces = "in_value", ValueScan(), []
            return i
        elif state == "after" and c == ",":
            self.state = "key"
        else:
            self._broken(i)
            return i
        return i + 1

    def _piece(self, piece: str, end: bool, out: list[ToolCallDelta]) -> None:
        """The next ``piece`` of the key or value being read (``end``: it ends with this piece)."""
        if self.state == "key_text":
            self.pieces.append(piece)
            if end:
                self.field, self.state, self.scan = _string("".join(self.pieces)), "colon", None
            return
        if self.state == "in_value":
            if self.field == "name" and not self.call.named:
                self.pieces.append(piece)
                if end:
                    self._named(_string("".join(self.pieces)), out)
            elif self.field in ARGUMENT_KEYS and self.args in (None, self.field) and not self.args_done:
                self.args = self.field
                self.args_done = end
                if self.call.named:
                    self._send(piece, end, out)
                else:
                    self.args_held.append(piece)
        if end:
            self.state = "after" if self.state == "in_value" else "done"
            self.scan = None

    def _named(self, name: Any, out: list[ToolCallDelta]) -> None:
        if not isinstance(name, str):
            raise NotACall
        out.append(self.call.name(name))
        self.held = None
        if self.args is not None:
            self._send("".join(self.args_held), self.args_done, out)
            self.args_held = []

    def _send(self, piece: str, end: bool, out: list[ToolCallDelta]) -> None:
        delta = self.call.arguments(piece, end)
        if delta is not None:
            out.append(delta)

    def _end(self, out: list[ToolCallDelta]) -> None:
        """The object is over (its ``}``, or the end of the answer): a call only if it was named."""
        if not self.call.named:
            raise NotACall
        if self.args is None:
            self._send("{}", True, out)
        self.state = "done"

    def _broken(self, i: int) -> None:
        """Not JSON at ``i``: no call if unnamed, else the rest of the object is skipped to its end."""
        if not self.call.named:
            raise NotACall
        self.state, self.scan = "skip", ValueScan(depth=1)


def _string(text: str) -> str | None:
    """The string a JSON value holds; None for another value, or for text that is no JSON."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class CallObjects:
    """A run of call objects (``{...};{...}`` or ``{...}, {...}]``), fed as it arrives.

    ``feed(text, final)`` returns the deltas and what follows the run: None while it goes on, else the
    text from the first character that ends it, the ``terminator`` (not consumed) or the beginning of
    text that is no call (the rest of the answer, that object's text included, is content)."""

    def __init__(self, separators: str, terminator: str | None, new_id: Callable[[], str], first_index: int = 0) -> None:
        self.separators = WHITESPACE + separators
        self.terminator = terminator
        self.new_id = new_id
        self.index = first_index
        self.reader: CallReader | None = None

    def feed(self, text: str, final: bool) -> tuple[list[ToolCallDelta], str | None]:
        out: list[ToolCallDelta] = []
        i = 0
        while True:
            if self.reader is None:
                i = skip(text, i, self.separators)
                if i >= len(text):
                    return out, None
                if text[i] == self.terminator or text[i] != "{":
                    return out, text[i:]
                self.reader = CallReader(self.index, self.new_id())
                text, i = text[i:], 0
            try:
                deltas, end = self.reader.feed(text)
                out += deltas
                if end is None and final:
                    out += self.reader.finish()
            except NotACall:
                rest, self.reader = self.reader.text(), None
                return out, rest
            if end is None and not final:
                return out, None
            self.index += 1
            self.reader = None
            if end is None:
                return out, None
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

