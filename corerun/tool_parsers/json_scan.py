"""A small reader of JSON text that may be cut short (a model's answer so far).

It finds where a value ends and which fields an object has so far; it never builds the values.  A
parser streams a call's arguments as the raw characters of their value: every character of a value
not yet complete belongs to it, so the fragments concatenate to exactly the text the model wrote.
"""

from __future__ import annotations

import json
from typing import Container

WHITESPACE = " \t\n\r"
_SCALAR = frozenset("-+.0123456789eEtruefalsn")  # numbers, true, false, null

Span = tuple[int, int | None]  # a value's start, and its end (None while it is cut short)


def skip(text: str, i: int, chars: Container[str] = WHITESPACE) -> int:
    """The first index from ``i`` on whose character is not in ``chars``."""
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Past the closing quote of the string opening at ``text[i]``; None while it is cut short."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int, final: bool = False) -> int | None:
    """Past the JSON value starting at ``text[i]``; None while it is cut short.  With ``final`` a number
    or literal reaching the end of the text is complete (else one more digit could follow).

    ``ValueError`` when ``text[i]`` cannot start a value.  Brackets are matched, not validated.
    """
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth = 0
        j = i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    if c in _SCALAR:
        j = skip(text, i, _SCALAR)
        return j if j < len(text) or final else None
    raise ValueError(f"a JSON value cannot start with {c!r} (character {i})")


def object_fields(text: str, i: int, final: bool = False) -> tuple[dict[str, Span], int | None]:
    """The fields of the object opening at ``text[i]`` so far, ``{key: (value start, value end or None)}``,
    and the index past the object (None while it is cut short).  ``ValueError`` when the text so far
    cannot be the start of an object."""
    if text[i] != "{":
        raise ValueError(f"expected an object at character {i}, got {text[i]!r}")
    fields: dict[str, Span] = {}
    j = skip(text, i + 1)
    if j < len(text) and text[j] == "}":
        return fields, j + 1
    while True:
        j = skip(text, j)
        if j >= len(text):
            return fields, None
        if text[j] != '"':
            raise ValueError(f"expected a key at character {j}, got {text[j]!r}")
        end = string_end(text, j)
        if end is None:
            return fields, None
        key = json.loads(text[j:end])
        j = skip(text, end)
        if j >= len(text):
            return fields, None
        if text[j] != ":":
            raise ValueError(f"expected ':' after the key {key!r} at character {j}, got {text[j]!r}")
        j = skip(text, j + 1)
        if j >= len(text):
            return fields, None
        end = value_end(text, j, final)
        fields[key] = (j, end)
        if end is None:
            return fields, None
        j = skip(text, end)
        if j >= len(text):
            return fields, None
        if text[j] == "}":
            return fields, j + 1
        if text[j] != ",":
            raise ValueError(f"expected ',' or '}}' after the value of {key!r} at character {j}, got {text[j]!r}")
        j += 1


def held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (and is shorter than it): characters
    a stream holds back, since the next ones may complete the tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
