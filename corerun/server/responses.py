"""Pieces of OpenAI's response bodies: finish reasons, and logprobs in the completions and chat shapes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from corerun.outputs import CompletionOutput, Logprob


@dataclass
class ChoiceState:
    """How much of one choice a stream has sent."""

    text_sent: int = 0
    tokens_sent: int = 0
    finished: bool = False
    parsed: Any = None  # a chat choice's ChoiceOutput (tool calls, thinking), when the request needs one


def finish_reason(c: CompletionOutput) -> str | None:
    """OpenAI's spelling: ``stop`` (EOS, a stop token or string), ``length``; an aborted request reads ``abort``."""
    return c.finish_reason


def _lp(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf; OpenAI clients read a float


def _top(row: dict[int, Logprob], k: int) -> list[tuple[int, float]]:
    """The row's ``k`` most likely tokens, most likely first (the chosen token among them only if it ranks)."""
    ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in row.items() if lp.rank is not None and 1 <= lp.rank <= k)
    return [(tid, lp) for _, tid, lp in ranked]


def chat_logprobs(state: Any, token_ids: Sequence[int], rows: Sequence[dict[int, Logprob]] | None, k: int) -> dict[str, Any]:
    """``{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}`` for these tokens."""
    content = []
    for tid, row in zip(token_ids, rows or ()):
        text = state.token_text(tid)
        top = [{"token": state.token_text(t), "logprob": _lp(lp), "bytes": list(state.token_text(t).encode())}
               for t, lp in _top(row, k)]
        content.append({"token": text, "logprob": _lp(row[tid].logprob), "bytes": list(text.encode()),
                        "top_logprobs": top})
    return {"content": content}


def completion_logprobs(state: Any, token_ids: Sequence[int], rows: Sequence[dict[int, Logprob]] | None,
                        k: int, offset: int) -> dict[str, Any]:
    """The legacy completions shape: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, row in zip(token_ids, rows or ()):
        text = state.token_text(tid)
        tokens.append(text)
        lps.append(_lp(row[tid].logprob))
        tops.append({state.token_text(t): _lp(lp) for t, lp in _top(row, k)} or None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
