"""Stop strings (``SamplingParams.stop``), with vLLM's semantics, across token boundaries.

A request ends (``finish_reason="stop"``, ``stop_reason`` = the string) as soon as its decoded
output text contains one of its stop strings, wherever the token boundaries fall: ``"\\n\\n"`` may be
the end of one token and the start of the next.  The text returned stops just before the string
(``include_stop_str_in_output=False``, the default) or just after it; the token ids keep every
token generated.  Stop strings are looked for only once ``min_tokens`` tokens are out, as vLLM does.

While a request runs, the tail of its text that could still become a stop string is held back, so
a streamed output never shows characters that a later token turns into a (removed) stop string:
every text shown is a prefix of the final text.
"""

from __future__ import annotations

from typing import Sequence


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest stop string ending after ``start``: ``(index in text, string)``, or None.

    ``start`` is where the text new since the last look begins; an occurrence entirely before it
    was already looked for.  Of two strings found at the same index the longer wins.
    """
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
            best = (i, s)
    return best


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string (0 if none)."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


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
