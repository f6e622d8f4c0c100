"""Stop strings (``SamplingParams.stop``), with vLLM's semantics, across token boundaries.

A request ends (``finish_reason="stop"``, ``stop_reason`` = the string) as soon as its decoded
output text contains one of its stop strings, wherever the token boundaries fall: ``"\\n\\n"`` may be
the end of one token and the start of the next.  The text returned stops just before the string
(``include_stop_str_in_output=False``, the default) or just after it; the token ids keep every
token generated.  Stop strings are looked for only once ``min_tokens`` tokens are out, as vLLM does.

While a request runs, the tail of its text that could still become a stop string is held back, so
a streamed output never shows characters that a later token turns into a (removed) stop string:
every text shown is a prefix of the final text.

Cost.  A step looks only at the text that can still complete a stop string: the new text and the tail
held back before it (no longer than the longest stop string).  ``StopStrings`` prepares a request's
strings once (sorted, so one binary search per position tells whether a tail is the start of any of
them); ``StopMatcher`` keeps a running request's place, so each step scans only the held tail and the
new text.  The module functions do the same without a place kept, scanning at most the last
``longest - 1`` characters.  ``SamplingParams`` bounds the list and the length of each string.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from functools import lru_cache
from typing import Sequence


class StopStrings:
    """A request's stop strings, prepared once for look-ups whose cost hardly grows with their number."""

    __slots__ = ("strings", "longest", "_sorted", "_firsts")

    def __init__(self, stops: Sequence[str]) -> None:
        self.strings = tuple(stops)
        self.longest = max(map(len, self.strings), default=0)
        self._sorted = sorted(set(self.strings))
        self._firsts = frozenset(s[0] for s in self.strings if s)

    def find(self, text: str, start: int = 0, held: int | None = None) -> tuple[int, str] | None:
        """The earliest stop string ending after ``start``: ``(index in text, string)``, or None.

        ``start`` is where the text new since the last look begins; an occurrence entirely before it
        was already looked for.  ``held``, when known, is how much of the text before ``start`` may
        begin a stop string (:meth:`partial_len` of the last look): no occurrence starts earlier.
        Of two strings found at the same index the longer wins.
        """
        reach = self.longest - 1 if held is None else min(held, self.longest - 1)
        for i in range(max(start - reach, 0), len(text)):
            if text[i] in self._firsts:
                s = self._longest_at(text[i : i + self.longest])
                if s is not None and i + len(s) > start:  # (a shorter one at i would end earlier still)
                    return i, s
        return None

    def partial_len(self, text: str, start: int = 0) -> int:
        """Length of the longest tail of ``text`` that begins at or after ``start`` and is a proper
        prefix of a stop string (0 if none)."""
        n = len(text)
        for i in range(max(start, n - self.longest + 1, 0), n):
            if text[i] in self._firsts and self._begins_one(text[i:]):
                return n - i
        return 0

    def _begins_one(self, tail: str) -> bool:
        """Whether ``tail`` is a proper prefix of a stop string: the strings it begins follow it in sorted order."""
        j = bisect_left(self._sorted, tail)
        if j < len(self._sorted) and self._sorted[j] == tail:
            j += 1
        return j < len(self._sorted) and self._sorted[j].startswith(tail)

    def _longest_at(self, q: str) -> str | None:
        """The longest stop string that ``q`` begins with, or None.

        The greatest string ``s <= q`` in sorted order is it when it begins ``q``; otherwise every stop
        string that begins ``q`` is no longer than the common prefix of ``q`` and ``s``: look again there.
        """
        while q:
            j = bisect_right(self._sorted, q) - 1
            if j < 0:
                return None
            s = self._sorted[j]
            if q.startswith(s):
                return s
            k = 0
            while s[k] == q[k]:  # they differ before either ends: s < q and s does not begin q
                k += 1
            q = q[:k]
        return None


class StopMatcher:
    """A running request's look-out for its stop strings, over its text as it grows.

    Each :meth:`scan` looks only at the text new since the last one and at the tail held back before
    it (the only place a stop string can have begun), so a step costs in proportion to the new text,
    not to the text so far or to the length of the stop strings.
    """

    __slots__ = ("stops", "scanned", "held")

    def __init__(self, stops: StopStrings | Sequence[str]) -> None:
        self.stops = stops if isinstance(stops, StopStrings) else prepare(stops)
        self.scanned = 0  # characters of the text looked at so far
        self.held = 0  # length of the tail of those that may still grow into a stop string

    def scan(self, text: str) -> tuple[int, str] | None:
        """The earliest stop string ending in the text new since the last scan (``text`` only grows
        while the request runs; a shorter one is scanned afresh)."""
        if len(text) < self.scanned:
            self.scanned = self.held = 0
        start = self.scanned
        hit = self.stops.find(text, start, self.held)
        self.held = self.stops.partial_len(text, start - self.held)
        self.scanned = len(text)
        return hit

    def shown(self, text: str) -> str:
        """What the running request shows of ``text`` (the text last scanned): all but the held tail."""
        return text[: len(text) - self.held] if self.held else text


@lru_cache(maxsize=256)
def _prepared(stops: tuple[str, ...]) -> StopStrings:
    return StopStrings(stops)


def prepare(stops: Sequence[str]) -> StopStrings:
    """``StopStrings`` of ``stops``, made once per distinct tuple of strings (requests share them)."""
    return _prepared(tuple(stops))


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest stop string ending after ``start``: ``(index in text, string)``, or None (see
    :meth:`StopStrings.find`)."""
    return prepare(stops).find(text, start)


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string (0 if none)."""
    return prepare(stops).partial_len(text)


def running_text(text: str, stops: Sequence[str], include: bool) -> str:
    """What a running request shows of its ``text``: without the tail that may still grow into a stop
    string (nothing is held back when the stop string is to be kept in the output)."""
    if include or not stops:
        return text
    hold = partial_stop_len(text, stops)
    return text[: len(text) - hold] if hold else text


def final_text(text: str, stop: str, start: int, include: bool) -> str:
    """The text of a request that ``stop`` ended: cut at its occurrence ending after ``start`` (the text
    before the last token), before it or, with ``include``, after it."""
    i = text.find(stop, max(0, start - len(stop) + 1))
    if i < 0:  # the full decode differs from the incremental one: the first occurrence then
        i = text.find(stop)
    if i < 0:
        return text
    return text[: i + len(stop)] if include else text[:i]
