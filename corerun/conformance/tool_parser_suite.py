"""``ToolParserSuite`` and ``ReasoningParserSuite``: every tool-call and reasoning parser must pass them.

The references are golden transcripts: a model's answer in one syntax with the content and calls (or
thinking and answer) it means, written by hand.  A parser is fed the transcripts of every format its
capabilities declare (``formats``; a parser of another syntax lists its own as ``transcripts`` on its
class), whole and streamed:

- ``whole``: ``parse(text)`` gives the golden content and calls (names, arguments equal as JSON, ids
  present and distinct).
- ``every_split``: the text fed in two pieces, at every split point, reassembles (:func:`assemble`) to
  the golden answer; every stream keeps OpenAI's delta shape (index order, id and name once).
- ``chunkings``: the same for 20 random chunkings (1 to 8 characters) and one character at a time.
- ``incremental`` (``streaming=True``): fed one character at a time, the arguments of a call come in
  more than one delta, before the call's text is complete.
- ``fresh_streams``: two streams of one parser, fed alternately, do not share state.

Transcripts with several calls are fed only to parsers declaring ``parallel_calls``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import pytest

from corerun.conformance.suite import Case, ConformanceSuite
from corerun.conformance.target import Target
from corerun.tool_parsers.protocol import ParsedTools, ReasoningDelta, ToolDelta, assemble

CHUNKINGS = 20


@dataclass(frozen=True)
class Transcript:
    """A model's answer and what it means: ``content``, and ``calls`` as ``(name, arguments)`` with the
    arguments as Python values (compared with the parsed JSON).  ``incremental``: the first call's
    arguments are written as JSON the parser can stream (not a string holding JSON)."""

    id: str
    text: str
    content: str
    calls: tuple[tuple[str, Any], ...] = ()
    incremental: bool = True


@dataclass(frozen=True)
class ReasoningTranscript:
    id: str
    text: str
    reasoning: str
    content: str


def _hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


WEATHER = '{"city": "Paris", "unit": "celsius"}'
NESTED = '{"query": {"terms": ["a \\"quoted\\" word", "{not json}", "Zürich 😀"], "limit": 3, "exact": false, "x": null}}'
NESTED_VALUE = {"query": {"terms": ['a "quoted" word', "{not json}", "Zürich 😀"], "limit": 3, "exact": False, "x": None}}

TRANSCRIPTS: dict[str, list[Transcript]] = {
    "hermes": [
        Transcript("content-only", "The weather in Paris is mild today.", "The weather in Paris is mild today."),
        Transcript("lookalikes", "a < b, and <tool_c or <tool_call is no tag.", "a < b, and <tool_c or <tool_call is no tag."),
        Transcript("one-call", _hermes("get_weather", WEATHER), "", (("get_weather", {"city": "Paris", "unit": "celsius"}),)),
        Transcript("content-then-call", "Let me check.\n" + _hermes("get_weather", WEATHER), "Let me check.\n",
                   (("get_weather", {"city": "Paris", "unit": "celsius"}),)),
        Transcript("two-calls", _hermes("get_weather", WEATHER) + "\n" + _hermes("get_time", "{}"), "\n",
                   (("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {}))),
        Transcript("nested-arguments", _hermes("search", NESTED), "", (("search", NESTED_VALUE),)),
        Transcript("arguments-as-string", _hermes("get_weather", json.dumps(WEATHER)), "",
                   (("get_weather", {"city": "Paris", "unit": "celsius"}),), incremental=False),
        Transcript("not-a-call", 'Look: <tool_call>{"nope": 1}</tool_call> done', 'Look: <tool_call>{"nope": 1}</tool_call> done'),
    ],
    "llama3_json": [
        Transcript("content-only", "Paris is the capital of France.", "Paris is the capital of France."),
        Transcript("one-call", '{"name": "get_weather", "parameters": ' + WEATHER + "}", "",
                   (("get_weather", {"city": "Paris", "unit": "celsius"}),)),
        Transcript("python-tag", '<|python_tag|>{"name": "get_weather", "parameters": ' + WEATHER + "}", "",
                   (("get_weather", {"city": "Paris", "unit": "celsius"}),)),
        Transcript("two-calls", '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"s": "semi;colon"}}', "",
                   (("a", {"x": 1}), ("b", {"s": "semi;colon"}))),
        Transcript("nested-arguments", '{"name": "search", "parameters": ' + NESTED + "}", "", (("search", NESTED_VALUE),)),
        Transcript("json-not-a-call", '{"answer": 42}', '{"answer": 42}'),
        Transcript("call-then-text", '{"name": "f", "parameters": {}} Done.', "Done.", (("f", {}),)),
    ],
    "mistral": [
        Transcript("content-only", "Brackets [TOOL_CALL] and [TOOL are text.", "Brackets [TOOL_CALL] and [TOOL are text."),
        Transcript("list-one", '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + WEATHER + "}]", "",
                   (("get_weather", {"city": "Paris", "unit": "celsius"}),)),
        Transcript("content-then-list-two", 'Sure.[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
                   "Sure.", (("a", {"x": 1}), ("b", {}))),
        Transcript("args-one", "[TOOL_CALLS]get_weather[ARGS]" + WEATHER, "",
                   (("get_weather", {"city": "Paris", "unit": "celsius"}),)),
        Transcript("args-two", '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]search[ARGS]' + NESTED, "",
                   (("a", {"x": 1}), ("search", NESTED_VALUE))),
    ],
}

REASONING = "First, 2 < 3; the <thin> tag is no tag.\nSo: yes."
REASONING_TRANSCRIPTS: dict[bool, list[ReasoningTranscript]] = {  # by starts_in_reasoning
    False: [
        ReasoningTranscript("both", f"<think>{REASONING}</think>\n\nYes.", REASONING, "\n\nYes."),
        ReasoningTranscript("leading-space", f"\n<think>{REASONING}</think>Yes.", REASONING, "Yes."),
        ReasoningTranscript("no-thinking", "Yes, it is </think> as text.", "", "Yes, it is </think> as text."),
        ReasoningTranscript("unclosed", f"<think>{REASONING}", REASONING, ""),
    ],
    True: [
        ReasoningTranscript("opened-in-prompt", f"{REASONING}</think>\n\nYes.", REASONING, "\n\nYes."),
        ReasoningTranscript("tag-repeated", f"<think>{REASONING}</think>Yes.", REASONING, "Yes."),
        ReasoningTranscript("unclosed", REASONING, REASONING, ""),
    ],
}


def _chunks(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 8)
        out.append(text[i:i + n])
        i += n
    return out


def _fail(message: str) -> None:
    pytest.fail(message, pytrace=False)


def _impl_class(target: Target) -> Any:
    if target.factory is not None:
        return target.factory
    from corerun.plugin.registry import resolve

    return resolve(target.registration.factory)


class _TextParserSuite(ConformanceSuite):
    def pick_device(self, target: Target) -> str:
        return "cpu"  # parsers read text: no device


class ToolParserSuite(_TextParserSuite):
    """The tool-call parser conformance suite.  Adopt it with::

        class TestMine(ToolParserSuite):
            implementation = "mine"           # a registered name, or:
            # factory = MyParser              # factory(**options) -> a ToolParser
            # capabilities = ToolParserCapabilities(formats=frozenset({"hermes"}))
    """

    kind = "tool_parser"

    def transcripts(self, target: Target) -> list[tuple[str, Transcript]] | str:
        caps = target.capabilities
        own = list(getattr(_impl_class(target), "transcripts", ()) or ())
        unknown = sorted(f for f in caps.formats if f not in TRANSCRIPTS)
        if unknown and not own:
            return (f"{target.label} declares the formats {unknown}, which have no golden transcripts here; "
                    "list Transcript(...) examples as `transcripts` on its class")
        made = [(f"{f}-{t.id}", t) for f in sorted(caps.formats) if f in TRANSCRIPTS for t in TRANSCRIPTS[f]]
        made += [(f"own-{t.id}", t) for t in own]
        return [(i, t) for i, t in made if caps.parallel_calls or len(t.calls) <= 1]

    def configs(self, check: str, target: Target, full: bool) -> list[tuple[str, Any]] | str:
        made = self.transcripts(target)
        if isinstance(made, str):
            return [("no-transcripts", made)]
        if check == "incremental":
            if not target.capabilities.streaming:
                return f"{target.label} declares streaming=False: each call comes whole"
            made = [(i, t) for i, t in made if t.calls and t.incremental and len(json.dumps(t.calls[0][1])) >= 10]
        return list(made)

    # ------------------------------------------------------------------ helpers
    def _transcript(self, case: Case) -> Transcript:
        self.start(case)
        if isinstance(case.config, str):
            _fail(case.config)
        return case.config

    @staticmethod
    def _compare(what: str, got: ParsedTools, want: Transcript) -> None:
        if got.content != want.content:
            _fail(f"{what}: content {got.content!r}, the transcript means {want.content!r}")
        names = [c.name for c in got.tool_calls]
        if names != [name for name, _ in want.calls]:
            _fail(f"{what}: calls {names}, the transcript means {[name for name, _ in want.calls]}")
        for i, (call, (name, args)) in enumerate(zip(got.tool_calls, want.calls)):
            try:
                value = json.loads(call.arguments)
            except ValueError:
                _fail(f"{what}: call {i} ({name}) has arguments {call.arguments!r}, which are not JSON")
            if value != args:
                _fail(f"{what}: call {i} ({name}) has arguments {value!r}, the transcript means {args!r}")
        ids = [c.id for c in got.tool_calls]
        if any(not isinstance(i, str) or not i for i in ids) or len(set(ids)) != len(ids):
            _fail(f"{what}: call ids {ids} must be distinct non-empty strings")

    @staticmethod
    def _streamed(parser: Any, pieces: list[str], what: str) -> tuple[ParsedTools, list[ToolDelta]]:
        s = parser.stream(None)
        deltas = [s.feed(p) for p in pieces] + [s.finish()]
        for d in deltas:
            if not isinstance(d, ToolDelta):
                _fail(f"{what}: feed/finish returned {type(d).__name__}, not a ToolDelta")
        try:
            return assemble(deltas), deltas
        except ValueError as exc:
            _fail(f"{what}: the deltas break OpenAI's shape: {exc}")
            raise

    # ------------------------------------------------------------------ checks
    def test_whole(self, case: Case) -> None:
        t = self._transcript(case)
        self._compare("parse(text)", case.target.create().parse(t.text, None), t)

    def test_every_split(self, case: Case) -> None:
        t = self._transcript(case)
        parser = case.target.create()
        for k in range(len(t.text) + 1):
            got, _ = self._streamed(parser, [t.text[:k], t.text[k:]], f"fed split at character {k}")
            self._compare(f"fed split at character {k} ({t.text[:k][-12:]!r} | {t.text[k:][:12]!r})", got, t)

    def test_chunkings(self, case: Case) -> None:
        t = self._transcript(case)
        parser = case.target.create()
        got, _ = self._streamed(parser, list(t.text), "fed one character at a time")
        self._compare("fed one character at a time", got, t)
        rng = random.Random(20240917)
        for n in range(CHUNKINGS):
            pieces = _chunks(t.text, rng)
            got, _ = self._streamed(parser, pieces, f"chunking {n} {pieces[:6]}...")
            self._compare(f"chunking {n} {pieces[:6]}...", got, t)

    def test_incremental(self, case: Case) -> None:
        t = self._transcript(case)
        _, deltas = self._streamed(case.target.create(), list(t.text), "fed one character at a time")
        pieces = [p for d in deltas for p in d.tool_calls if p.index == 0 and p.arguments]
        if len(pieces) < 2:
            _fail(f"the arguments of call 0 came in {len(pieces)} delta(s) when fed one character at a time; a parser "
                  "declaring streaming=True sends them as they arrive (or declare streaming=False)")

    def test_fresh_streams(self, case: Case) -> None:
        t = self._transcript(case)
        parser = case.target.create()
        plain = Transcript("plain", "Nothing to call here, thanks.", "Nothing to call here, thanks.")
        a, b = parser.stream(None), parser.stream(None)
        da: list[ToolDelta] = []
        db: list[ToolDelta] = []
        for i in range(max(len(t.text), len(plain.text))):
            if i < len(t.text):
                da.append(a.feed(t.text[i]))
            if i < len(plain.text):
                db.append(b.feed(plain.text[i]))
        da.append(a.finish())
        db.append(b.finish())
        self._compare("a stream fed alongside another stream of the same parser", assemble(da), t)
        self._compare("a plain-text stream fed alongside this transcript's stream", assemble(db), plain)


class ReasoningParserSuite(_TextParserSuite):
    """The reasoning parser conformance suite.  Adopt it with::

        class TestMine(ReasoningParserSuite):
            implementation = "mine"
    """

    kind = "reasoning_parser"

    def configs(self, check: str, target: Target, full: bool) -> list[tuple[str, Any]] | str:
        caps = target.capabilities
        if (caps.start, caps.end) != ("<think>", "</think>"):
            own = list(getattr(_impl_class(target), "transcripts", ()) or ())
            return [(t.id, t) for t in own] or f"{target.label} reads {caps.start}...{caps.end}; list its transcripts"
        return [(t.id, t) for t in REASONING_TRANSCRIPTS[caps.starts_in_reasoning]]

    @staticmethod
    def _compare(what: str, got: ReasoningDelta, want: ReasoningTranscript) -> None:
        if (got.reasoning, got.content) != (want.reasoning, want.content):
            _fail(f"{what}: reasoning {got.reasoning!r} and content {got.content!r}; the transcript means "
                  f"{want.reasoning!r} and {want.content!r}")

    @staticmethod
    def _streamed(parser: Any, pieces: list[str]) -> ReasoningDelta:
        s = parser.stream()
        deltas = [s.feed(p) for p in pieces] + [s.finish()]
        return ReasoningDelta("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas))

    def test_whole(self, case: Case) -> None:
        self.start(case)
        t = case.config
        self._compare("parse(text)", case.target.create().parse(t.text), t)

    def test_every_split(self, case: Case) -> None:
        self.start(case)
        t, parser = case.config, case.target.create()
        for k in range(len(t.text) + 1):
            self._compare(f"fed split at character {k}", self._streamed(parser, [t.text[:k], t.text[k:]]), t)

    def test_chunkings(self, case: Case) -> None:
        self.start(case)
        t, parser = case.config, case.target.create()
        self._compare("fed one character at a time", self._streamed(parser, list(t.text)), t)
        rng = random.Random(20240917)
        for n in range(CHUNKINGS):
            pieces = _chunks(t.text, rng)
            self._compare(f"chunking {n} {pieces[:6]}...", self._streamed(parser, pieces), t)
