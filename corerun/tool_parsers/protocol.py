"""The ``ToolParser`` and ``ReasoningParser`` protocols: a model's text in, OpenAI's message fields out.

A tool-call parser reads the calls a model writes in its own syntax (``<tool_call>{...}</tool_call>``,
``[TOOL_CALLS][...]``, a bare ``{"name": ..., "parameters": ...}``) and returns what OpenAI's chat API
sends: the text outside the calls as ``content``, and ``tool_calls`` with ids, names and arguments (JSON
text).  A reasoning parser splits the thinking (``<think>...</think>``) from the answer.

Whole text (a non-streamed answer)::

    parser.parse(text, tools) -> ParsedTools(content="Let me look.", tool_calls=(ToolCall(id, name, arguments),))
    reasoning.parse(text)     -> ReasoningDelta(reasoning="...", content="...")

Streamed, one stream per choice (it keeps that choice's state; the parser keeps none)::

    s = parser.stream(tools)
    s.feed("Let me <tool_c")    -> ToolDelta(content="Let me ")            # "<tool_c" held: it may open a call
    s.feed('all>{"name": "get')  -> ToolDelta()                              # the name is not complete yet
    s.feed('_weather", "argu')   -> ToolDelta(tool_calls=[ToolCallDelta(0, id="call_...", name="get_weather")])
    s.feed('ments": {"city": ') -> ToolDelta(tool_calls=[ToolCallDelta(0, arguments='{"city": ')])
    ...
    s.finish()                  -> ToolDelta(...)                          # whatever was held back

Deltas are OpenAI's: a call's first delta carries its ``index`` (0, 1, ... in order), ``id`` and
``name`` (arguments ``""`` or a first fragment); later deltas of that index carry argument fragments
only.  Concatenating every delta (:func:`assemble`) gives exactly what ``parse`` returns for the whole
text, however the text was split into ``feed`` calls.  ``tools`` is the request's OpenAI ``tools``
list (or ``None``); a parser may use it, for instance to know the names it may meet.

Factory: ``factory(**options) -> ToolParser`` (or ``ReasoningParser``).  Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Mapping, Protocol, Sequence, runtime_checkable

Tools = Sequence[Mapping[str, Any]] | None


@dataclass(frozen=True)
class ToolParserCapabilities:
    """What a tool-call parser reads.

    - ``formats``: the call syntaxes it reads, by name (``hermes``, ``llama3_json``, ``mistral``); the
      conformance suite feeds it the golden transcripts of each.
    - ``parallel_calls``: it reads several calls in one answer (else only the first is a call).
    - ``streaming``: arguments are streamed as they arrive (else each call comes in one delta once complete).
    - ``template_markers``: text whose presence in a chat template says the model writes this syntax;
      ``--tool-call-parser auto`` picks the one parser whose markers a template holds.
    """

    formats: frozenset[str]
    parallel_calls: bool = True
    streaming: bool = True
    template_markers: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"formats": sorted(self.formats), "parallel_calls": self.parallel_calls, "streaming": self.streaming,
                "template_markers": list(self.template_markers)}


@dataclass(frozen=True)
class ReasoningParserCapabilities:
    """What a reasoning parser reads: thinking between ``start`` and ``end``; ``starts_in_reasoning``: the
    chat template opens the thinking in the prompt, so the answer begins inside it (the opening tag is
    optional in the output)."""

    start: str = "<think>"
    end: str = "</think>"
    starts_in_reasoning: bool = False
    streaming: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "starts_in_reasoning": self.starts_in_reasoning,
                "streaming": self.streaming}


@dataclass(frozen=True)
class ToolCall:
    """One complete call: OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}``."""

    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one call in a stream: the first piece of ``index`` has ``id`` and ``name``, the rest neither."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": self.index}
        fn: dict[str, Any] = {}
        if self.id is not None:
            d["id"] = self.id
            d["type"] = "function"
        if self.name is not None:
            fn["name"] = self.name
        fn["arguments"] = self.arguments
        d["function"] = fn
        return d


@dataclass
class ToolDelta:
    """What one ``feed`` (or ``finish``) makes: new content, and pieces of calls."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass(frozen=True)
class ParsedTools:
    """A whole answer: the text outside the calls, and the calls in order."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ReasoningDelta:
    """The thinking and the answer: of a whole text (``parse``) or of one piece of it (a stream)."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


@runtime_checkable
class ToolCallStream(Protocol):
    def feed(self, text: str) -> ToolDelta:
        """The deltas that ``text`` (the model's next characters) completes; text that may still turn out to
        be part of a call is held until it is known."""
        ...

    def finish(self) -> ToolDelta:
        """The answer ended: everything held back, as content or as the rest of a call cut short."""
        ...


@runtime_checkable
class ToolParser(Protocol):
    name: ClassVar[str]
    capabilities: ClassVar[ToolParserCapabilities]

    def parse(self, text: str, tools: Tools = None) -> ParsedTools:
        """The content and calls of a whole answer."""
        ...

    def stream(self, tools: Tools = None) -> ToolCallStream:
        """A fresh stream for one answer."""
        ...


@runtime_checkable
class ReasoningStream(Protocol):
    def feed(self, text: str) -> ReasoningDelta:
        ...

    def finish(self) -> ReasoningDelta:
        ...


@runtime_checkable
class ReasoningParser(Protocol):
    name: ClassVar[str]
    capabilities: ClassVar[ReasoningParserCapabilities]

    def parse(self, text: str) -> ReasoningDelta:
        """The thinking and the answer of a whole text."""
        ...

    def stream(self) -> ReasoningStream:
        ...


def assemble(deltas: Iterable[ToolDelta]) -> ParsedTools:
    """What a client rebuilds from a stream: content concatenated, each index's id and name from its
    first delta and its argument fragments concatenated.  ``ValueError`` names the first delta that
    breaks OpenAI's shape (an index out of order, an id or name given twice or missing)."""
    content: list[str] = []
    calls: list[list[Any]] = []  # [id, name, [fragments]]
    for n, d in enumerate(deltas):
        content.append(d.content)
        for piece in d.tool_calls:
            if piece.index == len(calls):
                if piece.id is None or piece.name is None:
                    raise ValueError(f"delta {n}: the first delta of tool call {piece.index} has no "
                                     f"{'id' if piece.id is None else 'name'}; it must carry both")
                calls.append([piece.id, piece.name, [piece.arguments]])
            elif piece.index < len(calls):
                if piece.id is not None or piece.name is not None:
                    raise ValueError(f"delta {n}: tool call {piece.index} got an id or name again "
                                     f"({piece.id!r}, {piece.name!r}); only its first delta carries them")
                calls[piece.index][2].append(piece.arguments)
            else:
                raise ValueError(f"delta {n}: tool call index {piece.index} skips {len(calls)}; indexes go 0, 1, ...")
    return ParsedTools("".join(content), tuple(ToolCall(i, name, "".join(a)) for i, name, a in calls))
