"""Where a JSON value ends, found as its text arrives (a model's answer so far), each character read once.

A parser streams a call's arguments as the raw characters of their value, so it never builds a value:
it needs only where each one starts and ends.  :class:`ValueScan` keeps its place between pieces
(inside a string, after a backslash, how deep in brackets), so a value that arrives in n pieces costs
time in its length, not n times its length as reading the text so far again at every piece would.
"""

from __future__ import annotations

import re
from typing import Container

WHITESPACE = " \t\n\r"
_SCALAR = frozenset("-+.0123456789eEtruefalsn")  # numbers, true, false, null
_IN_STRING = re.compile(r'["\\]')  # what ends a string, or escapes the next character
_IN_BRACKETS = re.compile(r'["\[\]{}]')  # what changes the depth, or opens a string


def skip(text: str, i: int, chars: Container[str] = WHITESPACE) -> int:
    """The first index from ``i`` on whose character is not in ``chars``."""
    while i < len(text) and text[i] in chars:
        i += 1
    return i


class ValueScan:
    """One JSON value fed piece by piece; brackets are matched, not validated.

    ``feed(text, i)`` reads ``text[i:]`` (the first piece must start at the value's first character) and
    returns the index in ``text`` just past the value, or None when the value goes on past ``text``.
    A number or literal ends at the first character that cannot continue it; one that reaches the end
    of the answer is complete there (``scalar`` says the value is one).  ``ValueError`` when the first
    character cannot start a value.
    """

    __slots__ = ("depth", "string", "escape", "scalar", "started")

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth  # open brackets; a scan started inside an object passes 1
        self.string = False
        self.escape = False  # a backslash ended the last piece
        self.scalar = False
        self.started = depth > 0

    def feed(self, text: str, i: int = 0) -> int | None:
        n = len(text)
        if i < n and not self.started:
            self.started = True
            c = text[i]
            if c == '"':
                self.string, i = True, i + 1
            elif c in "{[":
                self.depth, i = 1, i + 1
            elif c in _SCALAR:
                self.scalar = True
            else:
                raise ValueError(f"a JSON value cannot start with {c!r}")
        while i < n:
            if self.escape:
                self.escape, i = False, i + 1
            elif self.string:
                m = _IN_STRING.search(text, i)
                if m is None:
                    return None
                i = m.end()
                if m.group() == "\\":
                    self.escape = True
                    continue
                self.string = False
                if self.depth == 0:
                    return i
            elif self.scalar:
                i = skip(text, i, _SCALAR)
                return i if i < n else None
            else:
                m = _IN_BRACKETS.search(text, i)
                if m is None:
                    return None
                i, c = m.end(), m.group()
                if c == '"':
                    self.string = True
                elif c in "{[":
                    self.depth += 1
                else:
                    self.depth -= 1
                    if self.depth == 0:
                        return i
        return None


def held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (and is shorter than it): characters
    a stream holds back, since the next ones may complete the tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
