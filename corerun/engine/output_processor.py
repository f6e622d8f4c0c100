"""Output processing: what a step's tokens mean to the user.

Per request it keeps the incremental detokeniser's state (the text so far, decoding only new tokens
with a few tokens of left context, as vLLM does), looks for stop strings in the text each new token
adds (:mod:`corerun.engine.stop_strings`), turns logprob tensors into ``{token id: Logprob}`` dicts
and builds :class:`~corerun.outputs.RequestOutput`.  It reads sequences and never changes what the
scheduler owns: a stop string it finds is handed back to the engine, which ends the request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence as Seq

from corerun.core.batch import StepResult
from corerun.core.sequence import Sequence
from corerun.engine import parallel_sampling
from corerun.engine.parallel_sampling import SequenceGroup
from corerun.engine.stop_strings import StopMatcher, final_text, running_text
from corerun.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from corerun.protocols.sampler import LogprobsTensors

NON_FINITE_PROMPT = ("the prompt logprobs of this request were not finite (NaN, +inf or -inf) at prompt position "
                     "{position}: the model or the dtype's range produced non-finite logits there")


@dataclass(slots=True)
class _Detok:
    """One request's incremental detokenisation: ``text`` of its first ``read`` output tokens, the left
    context starting at output token ``prefix``; ``skip``: its ``skip_special_tokens``; ``stops``: its
    place in the text for its stop strings (None without any)."""

    skip: bool = True
    stops: StopMatcher | None = None
    text: str = ""
    prefix: int = 0
    read: int = 0


@dataclass(slots=True)
class StepLogprobs:
    """A step's logprob dicts, made before any sequence changes (a malformed tensor fails the step whole)."""

    rows: dict[int, dict[int, Logprob]]  # seq_id -> the sampled token's dict
    prompt: dict[int, list[dict[int, Logprob]]]  # seq_id -> prompt positions computed this step
    non_finite: dict[int, str]  # seq_id -> the error it ends with: prompt logprobs not finite, never served


NO_LOGPROBS = StepLogprobs({}, {}, {})  # a step in which no request asked for logprobs (never changed)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._detok: dict[int, _Detok] = {}  # seq_id -> its detokeniser state

    # ------------------------------------------------------------- logprobs
    def logprobs(self, seqs: Seq[Sequence | None], result: StepResult) -> StepLogprobs:
        """The step's logprob dicts (``seqs``: the batch's row's sequences, ``None`` for one finished since);
        raises on a malformed sampler output."""
        prompt = {seqs[i].seq_id: logprob_dicts(lp, seqs[i].params.prompt_logprobs or 0)  # type: ignore[union-attr]
                  for i, (_, lp) in result.prompt_logprobs.items() if seqs[i] is not None}
        starts = {seqs[i].seq_id: start for i, (start, _) in result.prompt_logprobs.items() if seqs[i] is not None}
        non_finite = {}
        for sid, dicts in prompt.items():  # host lists already: only requests asking for prompt logprobs pay
            bad = next((j for j, d in enumerate(dicts) if not all(math.isfinite(v.logprob) for v in d.values())), None)
            if bad is not None:
                non_finite[sid] = NON_FINITE_PROMPT.format(position=starts[sid] + bad)
        rows: dict[int, dict[int, Logprob]] = {}
        if result.logprobs is not None:
            dicts = logprob_dicts(result.logprobs, [s.params.logprobs or 0 if s is not None else 0
                                                    for s in (seqs[r] for r in result.rows)])
            rows = {seqs[r].seq_id: d for r, d in zip(result.rows, dicts) if seqs[r] is not None}  # type: ignore[union-attr]
        return StepLogprobs(rows, prompt, non_finite)

    @staticmethod
    def add_logprobs(seqs: Seq[Sequence], lps: StepLogprobs, failed: dict[int, str]) -> None:
        """Append the step's logprob dicts to the sequences that took the step's tokens."""
        for seq in seqs:
            sid = seq.seq_id
            if sid in failed or sid in lps.non_finite or seq.finish_reason == "error":  # (its step's token was not taken)
                continue
            if sid in lps.prompt:
                if seq.prompt_logprobs is None:
                    seq.prompt_logprobs = [None]
                seq.prompt_logprobs.extend(lps.prompt[sid])
            if sid in lps.rows and seq.logprobs is not None:
                seq.logprobs.append(lps.rows[sid])

    # ---------------------------------------------------------- stop strings
    def stop_strings(self, touched: Seq[Sequence], new: dict[int, int]) -> list[tuple[Sequence, str, int]]:
        """``(seq, stop string, tokens to keep)`` for each touched sequence whose text gained one of its
        stop strings; ``new[seq_id]``: output tokens it got this step, looked at one by one (the last
        one only while the scheduler did not end the request there: a stop token or the length wins)."""
        hits = []
        for seq in touched:
            stops = seq.params.stop
            if not stops or self.tokenizer is None:
                continue
            ids = seq.output_token_ids
            first = len(ids) - new.get(seq.seq_id, 1)
            last = len(ids) - 1 if seq.is_finished else len(ids)
            state = self._state(seq)
            for m in range(first + 1, last + 1):
                hit = state.stops.scan(self._advance(state, ids, m))  # type: ignore[union-attr]
                if hit is not None and m >= seq.params.min_tokens:
                    hits.append((seq, hit[1], seq.num_prompt_tokens + m))
                    break
        return hits

    # ---------------------------------------------------------------- output
    def output(self, seq: Sequence | SequenceGroup) -> RequestOutput:
        """The request's output so far (an ``n > 1`` group: every sample's)."""
        if isinstance(seq, SequenceGroup):
            return parallel_sampling.group_output(seq, self._output_one)
        return self._output_one(seq)

    def _output_one(self, seq: Sequence) -> RequestOutput | EmbeddingRequestOutput:
        if seq.params.pooling is not None:
            return EmbeddingRequestOutput(
                request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=list(seq.prompt_token_ids),
                outputs=EmbeddingOutput(list(seq.pooled or ())), finished=seq.is_finished,
                finish_reason=seq.finish_reason, error=seq.error,
            )
        ids = seq.output_token_ids
        text = self._text(seq, ids) if self.tokenizer is not None else ""
        p = seq.params
        if p.stop and text and not seq.is_finished:
            matcher = self._state(seq).stops
            if p.include_stop_str_in_output or matcher is None or matcher.scanned != len(text):
                text = running_text(text, p.stop, p.include_stop_str_in_output)
            else:  # (the held tail its last scan found)
                text = matcher.shown(text)
        elif p.stop and text and isinstance(seq.stop_reason, str):  # ended by a stop string: cut there
            start = len(self.tokenizer.decode(ids[:-1], skip_special_tokens=p.skip_special_tokens))
            text = final_text(text, seq.stop_reason, start, p.include_stop_str_in_output)
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(ids), finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            logprobs=seq.logprobs, error=seq.error,
        )
        metrics = {"arrival_time": seq.arrival_time}
        if seq.first_token_time is not None:
            metrics["first_token_time"] = seq.first_token_time
        if seq.finish_time is not None:
            metrics["finish_time"] = seq.finish_time
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=list(seq.prompt_token_ids),
            outputs=[completion], finished=seq.is_finished, prompt_logprobs=seq.prompt_logprobs, metrics=metrics,
        )

    def release(self, seq_ids: Seq[int]) -> None:
        """Forget the detokeniser state of requests the engine no longer holds."""
        for sid in seq_ids:
            self._detok.pop(sid, None)

    # ---------------------------------------------------------- detokenising
    def _state(self, seq: Sequence) -> _Detok:
        state = self._detok.get(seq.seq_id)
        if state is None:
            p = seq.params
            state = self._detok[seq.seq_id] = _Detok(p.skip_special_tokens, StopMatcher(p.stop) if p.stop else None)
        return state

    def _text(self, seq: Sequence, ids: list[int]) -> str:
        """The output text: exact full decode once finished, incremental before."""
        if seq.is_finished:
            return self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)
        return self._advance(self._state(seq), ids)

    def _advance(self, state: _Detok, ids: Seq[int], end: int | None = None) -> str:
        """``state.text`` brought up to ``ids[:end]`` (all of ``ids`` by default), decoding only the new
        tokens (holding back half a character); only the tokens from ``state.prefix`` on are sliced."""
        tok = self.tokenizer
        prefix, read, skip = state.prefix, state.read, state.skip
        end = len(ids) if end is None else end
        if end > read:
            before = tok.decode(ids[prefix:read], skip_special_tokens=skip)
            after = tok.decode(ids[prefix:end], skip_special_tokens=skip)
            if len(after) > len(before) and not after.endswith("\ufffd"):
                state.text += after[len(before):]
                state.prefix = max(read - 4, 0)
                state.read = end
        return state.text


def logprob_dicts(lp: LogprobsTensors | None, k: int | Seq[int]) -> list[dict[int, Logprob]]:
    """LogprobsTensors rows -> ``{token id: Logprob}`` dicts: column 0 (the chosen token) first, then the top ``k``.

    ``k`` is one count for every row, or one per row: a batch carries as many top columns as its
    most demanding row asked for, and each row keeps only its own (vLLM's rule: the top ``k``, plus
    the chosen token when it is not among them).
    """
    if lp is None:
        return []
    ids = lp.token_ids.tolist()
    vals = lp.logprobs.tolist()
    ranks = lp.ranks.tolist()
    ks = [k] * len(ids) if isinstance(k, int) else list(k)
    if len(ks) > len(ids):
        raise ValueError(f"{len(ids)} logprob rows for {len(ks)} requests")
    out = []
    for row_ids, row_vals, rank, row_k in zip(ids, vals, ranks, ks):
        cols = min(len(row_ids), row_k + 1)
        d: dict[int, Logprob] = {row_ids[0]: Logprob(row_vals[0], rank)}
        for c in range(1, cols):
            d.setdefault(row_ids[c], Logprob(row_vals[c], c))
        out.append(d)
    return out
