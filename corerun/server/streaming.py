"""Response bodies from engine outputs: the whole answer, or OpenAI's server-sent-event chunks."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from corerun.outputs import CompletionOutput, RequestOutput
from corerun.server import protocol as P
from corerun.server.responses import ChoiceState, chat_logprobs, completion_logprobs, finish_reason
from corerun.server.serving import Serving
from corerun.server.tool_calls import ChoiceOutput, ToolPlan


def sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def _merged(streams: list[Any]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several engine requests as they come: ``(prompt index, output)``."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(i: int, s: Any) -> None:
        try:
            async for out in s:
                await q.put((i, out))
        except BaseException as exc:  # noqa: BLE001 (re-raised by the reader)
            await q.put(exc)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            item = await q.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item[1].finished:
                left -= 1
    finally:
        for t in tasks:
            t.cancel()


async def collect(streams: list[Any]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in _merged(streams):
        if out.finished:
            finals[i] = out
    return finals  # type: ignore[return-value]


def _usage(prompts: list[list[int]], completions: int) -> dict[str, int]:
    p = sum(len(x) for x in prompts)
    return {"prompt_tokens": p, "completion_tokens": completions, "total_tokens": p + completions}


def _error_of(finals: list[RequestOutput]) -> str | None:
    for out in finals:
        for c in out.outputs:
            if c.finish_reason == "error":
                return c.error or "the engine failed this request"
    return None


def full_response(state: Serving, req: Any, finals: list[RequestOutput], prompts: list[list[int]], rid: str,
                   created: int, chat: bool, tools: ToolPlan | None = None) -> dict[str, Any]:
    err = _error_of(finals)
    if err is not None:  # a plugin failed inside a step: the server's fault, not the request's
        raise P.APIError(500, f"the engine failed this request: {err}", code="engine_error")
    choices = []
    n = req.n
    total = 0
    for i, out in enumerate(finals):
        for c in out.outputs:
            total += len(c.token_ids)
            index = i * n + c.index
            if chat:
                parsed = tools.output() if tools else None
                choice = {"index": index,
                          "message": parsed.message(c.text) if parsed else {"role": "assistant", "content": c.text},
                          "logprobs": chat_logprobs(state, c.token_ids, c.logprobs, req.top_logprobs or 0) if req.logprobs else None,
                          "finish_reason": parsed.finish_reason(finish_reason(c)) if parsed else finish_reason(c),
                          "stop_reason": c.stop_reason}
            else:
                choice = {"index": index, "text": c.text,
                          "logprobs": completion_logprobs(state, c.token_ids, c.logprobs, req.logprobs, 0) if req.logprobs is not None else None,
                          "finish_reason": finish_reason(c), "stop_reason": c.stop_reason}
            choices.append(choice)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": state.name, "choices": choices, "usage": _usage(prompts, total)}


async def stream(state: Serving, req: Any, streams: list[Any], prompts: list[list[int]], rid: str, created: int,
                  chat: bool, tools: ToolPlan | None = None) -> AsyncIterator[bytes]:
    n = req.n
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    obj = "chat.completion.chunk" if chat else "text_completion"
    choices: dict[int, ChoiceState] = {}
    text_offsets: dict[int, int] = {}

    def chunk(choice_list: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": state.name, "choices": choice_list}
        if include_usage:
            body["usage"] = usage
        return sse(body)

    finished = 0
    try:
        if chat:  # the role first, one chunk per choice (as OpenAI does)
            for i in range(len(prompts) * n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
        try:
            async for i, out in _merged(streams):
                if out.finished:
                    finished += 1
                    state.metrics.finished(out)
                cut = state.cut_off_error([out]) if out.finished else None
                if cut is not None:
                    raise cut
                err = _error_of([out]) if out.finished else None
                if err is not None:
                    raise P.APIError(500, f"the engine failed this request: {err}", code="engine_error")
                parts = []
                for c in out.outputs:
                    index = i * n + c.index
                    st = choices.setdefault(index, ChoiceState(parsed=tools.output() if tools else None))
                    part = _delta(state, req, st, c, chat, text_offsets, index)
                    if part is not None:
                        parts.append(part)
                for part in parts:
                    yield chunk([part])
        except Exception as exc:  # headers are sent: the error travels as an event, and the stream still ends well
            e = exc if isinstance(exc, P.APIError) else P.APIError(500, f"the engine loop failed: {type(exc).__name__}: {exc}",
                                                                   code="engine_error")
            yield sse({"error": e.body()["error"]})
            yield b"data: [DONE]\n\n"
            return
        if include_usage:
            total = sum(st.tokens_sent for st in choices.values())
            yield chunk([], _usage(prompts, total))
        yield b"data: [DONE]\n\n"
    finally:
        state.in_flight.pop(rid, None)
        if finished < len(streams):  # the client went away, or the server is stopping: free the engine
            state.abort(streams)


def _delta(state: Serving, req: Any, st: ChoiceState, c: CompletionOutput, chat: bool, offsets: dict[int, int],
           index: int) -> dict[str, Any] | None:
    """This choice's new text (and the logprobs of its new tokens) since the last chunk; None if nothing new."""
    new_text = c.text[st.text_sent:]
    new_ids = c.token_ids[st.tokens_sent:]
    done = c.finish_reason is not None and not st.finished
    if not new_text and not new_ids and not done:
        return None
    logprobs = None
    lp_rows = c.logprobs[st.tokens_sent:] if c.logprobs is not None else None
    if chat and req.logprobs:
        logprobs = chat_logprobs(state, new_ids, lp_rows, req.top_logprobs or 0)
    elif not chat and req.logprobs is not None:
        logprobs = completion_logprobs(state, new_ids, lp_rows, req.logprobs, offsets.get(index, 0))
        offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
    st.text_sent += len(new_text)
    st.tokens_sent = len(c.token_ids)
    st.finished = c.finish_reason is not None
    reason = finish_reason(c) if st.finished else None
    if chat and st.parsed is not None:  # tool calls or thinking in the text: the parser says what is new
        fields = st.parsed.delta(new_text, st.finished)
        if not fields and logprobs is None and not st.finished:
            return None
        return {"index": index, "delta": fields, "logprobs": logprobs,
                "finish_reason": st.parsed.finish_reason(reason),
                **({"stop_reason": c.stop_reason} if st.finished else {})}
    if chat:
        return {"index": index, "delta": {"content": new_text} if new_text or not st.finished else {},
                "logprobs": logprobs, "finish_reason": reason, **({"stop_reason": c.stop_reason} if st.finished else {})}
    return {"index": index, "text": new_text, "logprobs": logprobs, "finish_reason": reason,
            **({"stop_reason": c.stop_reason} if st.finished else {})}
