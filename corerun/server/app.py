"""The FastAPI app: OpenAI's ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, plus
``/health`` and ``/metrics``, on the engine loop an :class:`~corerun.llm.LLM` already runs.

Every request joins the one engine loop (``LLM.engine_loop``) that ``LLM.generate`` and
``LLM.stream`` use, so the server adds no second scheduler.  User errors are answered before
anything is queued, as OpenAI's error object with status 400 (naming the field), 404 (unknown model)
or 413 (body too large); a full waiting queue answers 503 at once.  A client that goes away has its
requests aborted and their blocks freed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from corerun.errors import EngineClosedError, RequestError
from corerun.outputs import CompletionOutput, RequestOutput
from corerun.server import protocol as P
from corerun.server.metrics import ServerMetrics
from corerun.server.responses import ChoiceState, chat_logprobs, completion_logprobs, finish_reason

logger = logging.getLogger("corerun.server")


def model_name(llm: Any) -> str:
    cfg = llm.config
    if cfg.server.served_model_name:
        return cfg.server.served_model_name
    if cfg.model:
        return Path(cfg.model).name
    from corerun.models.default import MODEL_NAME

    return MODEL_NAME


class Serving:
    """What every route needs: the LLM (engine loop, tokenizer), the served name, limits, metrics."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.loop = llm.engine_loop
        self.tokenizer = llm.get_tokenizer()
        self.name = model_name(llm)
        self.cfg = llm.config.server
        self.max_model_len = self.engine.runner.max_model_len
        self.max_logprobs = llm.config.max_logprobs
        self.metrics = ServerMetrics(self.engine, self.name)
        self.admitting = 0  # requests between the queue check and the engine's waiting queue
        self.closing = False
        self._token_text: dict[int, str] = {}
        self._tasks: set[asyncio.Task] = set()  # recording the ends of aborted requests

    # ---------------------------------------------------------------- input
    def check_model(self, req: P._Request) -> None:
        if req.model is not None and req.model != self.name:
            raise P.APIError(404, f"model {req.model!r} does not exist; this server serves {self.name!r}",
                             param="model", code="model_not_found")

    def encode(self, text: str, field: str, special: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise P.APIError(400, f"{field}: this model has no tokenizer, so text cannot be served; send token ids",
                             param=field)
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    def completion_prompts(self, req: P.CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            prompts = [self.encode(p, "prompt")]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [self.encode(x, "prompt") for x in p]  # type: ignore[arg-type]
        else:
            prompts = [list(x) for x in p]  # type: ignore[arg-type]
        if not prompts or any(not x for x in prompts):
            raise P.APIError(400, "prompt: must not be empty", param="prompt")
        return prompts

    def chat_prompt(self, req: P.ChatCompletionRequest) -> list[int]:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise P.APIError(400, "messages: this model has no chat template; use /v1/completions", param="messages")
        try:
            text = tok.apply_chat_template(
                P.chat_text(req.messages), tokenize=False, add_generation_prompt=req.add_generation_prompt,
                **(req.chat_template_kwargs or {}),
            )
        except P.APIError:
            raise
        except Exception as exc:  # a template raising on these messages (e.g. roles out of order)
            raise P.APIError(400, f"messages: the chat template refused them: {type(exc).__name__}: {exc}",
                             param="messages") from None
        return self.encode(text, "messages", special=False)  # the template wrote the special tokens

    def check_length(self, prompts: list[list[int]], params_max: int | None, field: str) -> None:
        for ids in prompts:
            if len(ids) >= self.max_model_len:
                raise P.APIError(400, f"{field}: {len(ids)} tokens, but this model's context is {self.max_model_len} "
                                 "tokens (at least one must be left to generate); shorten it",
                                 param=field, code="context_length_exceeded")
            if params_max is not None and len(ids) + params_max > self.max_model_len:
                raise P.APIError(400, f"max_tokens: {params_max} + the prompt's {len(ids)} tokens exceed this "
                                 f"model's context of {self.max_model_len} tokens; ask for at most "
                                 f"{self.max_model_len - len(ids)}", param="max_tokens", code="context_length_exceeded")

    # --------------------------------------------------------------- engine
    async def submit(self, prompts: list[list[int]], params: Any, prefix: str) -> list[Any]:
        """Queue one engine request per prompt (all or none); 503 when the waiting queue is full."""
        if self.closing:
            raise P.APIError(503, "the server is shutting down", code="shutting_down")
        waiting = len(self.engine.scheduler.waiting) + self.admitting
        if waiting + len(prompts) > self.cfg.max_waiting_requests:
            self.metrics.reject("overloaded")
            raise P.APIError(503, f"the server is overloaded: {waiting} requests are waiting (server."
                             f"max_waiting_requests={self.cfg.max_waiting_requests}); retry later", code="overloaded")
        streams: list[Any] = []
        self.admitting += len(prompts)
        try:
            for i, ids in enumerate(prompts):
                streams.append(await self.loop.add_request_async(ids, params, request_id=f"{prefix}-{i}"))
        except RequestError as exc:
            self.abort(streams, record=False)
            raise P.APIError(400, str(exc), param=_param_of(str(exc))) from None
        except EngineClosedError:
            self.abort(streams, record=False)
            raise P.APIError(503, "the server is shutting down", code="shutting_down") from None
        except BaseException:
            self.abort(streams, record=False)
            raise
        finally:
            self.admitting -= len(prompts)
        return streams

    def abort(self, streams: list[Any], record: bool = True) -> None:
        """Abort the requests not finished yet; with ``record``, their final (``abort``) outputs still go to /metrics."""
        left = [s for s in streams if not s.finished]
        if not left:
            return
        try:
            self.loop.abort([s.request_id for s in left], wait=False)
        except Exception:  # the loop is gone (shutdown): nothing left to free
            logger.debug("abort after shutdown", exc_info=True)
            return
        if record:
            task = asyncio.ensure_future(self._record_ends(left))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _record_ends(self, streams: list[Any]) -> None:
        for s in streams:
            try:
                while not s.finished:
                    out = await s.get_async()
                    if out.finished:
                        self.metrics.finished(out)
            except Exception:  # noqa: BLE001 (the loop failed or shut down: nothing to record)
                return

    def token_text(self, tid: int) -> str:
        s = self._token_text.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid]) if self.tokenizer is not None else ""
            if len(self._token_text) < 1 << 16:
                self._token_text[tid] = s
        return s


def _param_of(message: str) -> str | None:
    head = message.split(":", 1)[0].strip()
    if head.startswith("prompt"):
        return "prompt"
    for name in ("logit_bias", "stop_token_ids", "stop", "logprobs", "max_tokens", "min_tokens", "temperature", "top_p",
                 "top_k", "seed"):
        if name in message:
            return name
    return None


def error_response(err: P.APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def read_json(request: Request, limit: int) -> Any:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise P.APIError(413, f"the request body is {size} bytes, above server.max_request_bytes={limit}",
                         code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise P.APIError(413, f"the request body is above server.max_request_bytes={limit} bytes",
                             code="request_too_large")
    try:
        return json.loads(body)
    except ValueError as exc:
        raise P.APIError(400, f"the request body is not valid JSON: {exc}") from None


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


async def _until_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def build_app(llm: Any) -> FastAPI:
    """The app serving ``llm``; shutting the app down (lifespan end) shuts ``llm`` down."""
    state = Serving(llm)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.closing = True
        await asyncio.to_thread(llm.shutdown)  # aborts what is still in flight, stops the engine loop

    app = FastAPI(title="corerun", lifespan=lifespan)
    app.state.serving = state

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, exc: P.APIError) -> JSONResponse:
        if exc.status in (400, 404, 413):
            state.metrics.reject("invalid")
        return error_response(exc)

    @app.get("/health")
    async def health() -> Response:
        if state.closing:
            return error_response(P.APIError(503, "the server is shutting down", code="shutting_down"))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": state.name, "object": "model", "created": int(time.time()), "owned_by": "corerun",
            "root": state.name, "max_model_len": state.max_model_len,
        }]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = P.parse_body(P.CompletionRequest, await read_json(request, state.cfg.max_request_bytes))
        state.check_model(req)
        P.unsupported(req)
        prompts = await asyncio.to_thread(state.completion_prompts, req)  # a long prompt must not stall the others
        params = P.sampling_params(req, default_max_tokens=16, max_logprobs=state.max_logprobs)
        state.check_length(prompts, req.max_tokens, "prompt")
        return await _serve(request, state, req, prompts, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = P.parse_body(P.ChatCompletionRequest, await read_json(request, state.cfg.max_request_bytes))
        state.check_model(req)
        P.unsupported(req)
        prompt = await asyncio.to_thread(state.chat_prompt, req)
        state.check_length([prompt], None, "messages")
        default = state.max_model_len - len(prompt)  # OpenAI's chat default: as long as the context allows
        params = P.sampling_params(req, default_max_tokens=default, max_logprobs=state.max_logprobs)
        state.check_length([prompt], req.max_completion_tokens or req.max_tokens, "messages")
        return await _serve(request, state, req, [prompt], params, chat=True)

    return app


async def _serve(request: Request, state: Serving, req: Any, prompts: list[list[int]], params: Any, chat: bool) -> Response:
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    streams = await state.submit(prompts, params, rid)
    created = int(time.time())
    if req.stream:
        return StreamingResponse(_stream(state, req, streams, prompts, rid, created, chat), media_type="text/event-stream")
    collect = asyncio.ensure_future(_collect(streams))
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not collect.done():  # the client went away (or this task was cancelled): free the engine
            collect.cancel()
            state.abort(streams)
    if not collect.done() or collect.cancelled():
        return Response(status_code=499)
    finals = collect.result()
    for out in finals:
        state.metrics.finished(out)
    return JSONResponse(_full_response(state, req, finals, prompts, rid, created, chat))


async def _collect(streams: list[Any]) -> list[RequestOutput]:
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


def _full_response(state: Serving, req: Any, finals: list[RequestOutput], prompts: list[list[int]], rid: str,
                   created: int, chat: bool) -> dict[str, Any]:
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
                choice = {"index": index, "message": {"role": "assistant", "content": c.text},
                          "logprobs": chat_logprobs(state, c.token_ids, c.logprobs, req.top_logprobs or 0) if req.logprobs else None,
                          "finish_reason": finish_reason(c), "stop_reason": c.stop_reason}
            else:
                choice = {"index": index, "text": c.text,
                          "logprobs": completion_logprobs(state, c.token_ids, c.logprobs, req.logprobs, 0) if req.logprobs is not None else None,
                          "finish_reason": finish_reason(c), "stop_reason": c.stop_reason}
            choices.append(choice)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": state.name, "choices": choices, "usage": _usage(prompts, total)}


async def _stream(state: Serving, req: Any, streams: list[Any], prompts: list[list[int]], rid: str, created: int,
                  chat: bool) -> AsyncIterator[bytes]:
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
        async for i, out in _merged(streams):
            if out.finished:
                finished += 1
                state.metrics.finished(out)
            err = _error_of([out]) if out.finished else None
            if err is not None:
                yield sse({"error": P.APIError(500, f"the engine failed this request: {err}", code="engine_error").body()["error"]})
                break
            parts = []
            for c in out.outputs:
                index = i * n + c.index
                st = choices.setdefault(index, ChoiceState())
                part = _delta(state, req, st, c, chat, text_offsets, index)
                if part is not None:
                    parts.append(part)
            for part in parts:
                yield chunk([part])
        if include_usage:
            total = sum(st.tokens_sent for st in choices.values())
            yield chunk([], _usage(prompts, total))
        yield b"data: [DONE]\n\n"
    finally:
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
    if chat:
        return {"index": index, "delta": {"content": new_text} if new_text or not st.finished else {},
                "logprobs": logprobs, "finish_reason": reason, **({"stop_reason": c.stop_reason} if st.finished else {})}
    return {"index": index, "text": new_text, "logprobs": logprobs, "finish_reason": reason,
            **({"stop_reason": c.stop_reason} if st.finished else {})}
