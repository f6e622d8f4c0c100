"""pytest-style ``-k`` expressions for the programmatic runner: ``decode and not bf16``, ``(prefill or mixed) and hd128``.

Each word matches, case-insensitively, as a substring of a check's id
(``attention-torch-decode[bf16-hd128-bs16-gqa4]``); ``and``, ``or``, ``not`` and parentheses combine.
"""

from __future__ import annotations

import re
from typing import Callable

_TOKEN = re.compile(r"\s*(\(|\)|[^\s()]+)")


def compile_keyword(expr: str | None) -> Callable[[str], bool]:
    """A predicate over check ids; ``None`` or an empty expression matches everything."""
    if not expr or not expr.strip():
        return lambda _text: True
    tokens = _TOKEN.findall(expr)
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        if pos >= len(tokens):
            raise ValueError(f"-k expression {expr!r} ends early")
        pos += 1
        return tokens[pos - 1]

    def parse_or() -> Callable[[str], bool]:
        left = parse_and()
        while peek() == "or":
            take()
            right, prev = parse_and(), left
            left = lambda t, a=prev, b=right: a(t) or b(t)  # noqa: E731
        return left

    def parse_and() -> Callable[[str], bool]:
        left = parse_not()
        while peek() == "and":
            take()
            right, prev = parse_not(), left
            left = lambda t, a=prev, b=right: a(t) and b(t)  # noqa: E731
        return left

    def parse_not() -> Callable[[str], bool]:
        tok = take()
        if tok == "not":
            inner = parse_not()
            return lambda t: not inner(t)
        if tok == "(":
            inner = parse_or()
            if take() != ")":
                raise ValueError(f"-k expression {expr!r}: missing ')'")
            return inner
        if tok in (")", "and", "or"):
            raise ValueError(f"-k expression {expr!r}: unexpected {tok!r}")
        word = tok.lower()
        return lambda t: word in t.lower()

    predicate = parse_or()
    if pos != len(tokens):
        raise ValueError(f"-k expression {expr!r}: unexpected {tokens[pos]!r}")
    return predicate
