"""The FastAPI app: OpenAI's ``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``, ``/v1/models``, plus
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
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from corerun.server import embeddings
from corerun.server import protocol as P
from corerun.server import tool_calls

from corerun.server.security import Guard
from corerun.server.lora import add_lora_routes
from corerun.server.serving import Serving
from corerun.server.streaming import collect, full_response, stream

logger = logging.getLogger("corerun.server")
MAX_JSON_DEPTH = 64  # deeper bodies are refused before validation walks them


def error_response(err: P.APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if err.status == 503 else None  # clients (openai's among them) back off and retry
    if err.status in (408, 413):  # the rest of the body is not read: this connection cannot carry another request
        headers = {"Connection": "close"}
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def read_json(request: Request, cfg: Any) -> Any:
    """The JSON body, read within ``cfg.read_timeout_s`` and ``cfg.max_request_bytes``."""
    limit, timeout_s = cfg.max_request_bytes, cfg.read_timeout_s
    kind = request.headers.get("content-type", "")
    if kind.split(";", 1)[0].strip().lower() != "application/json":
        raise P.APIError(415, f"Content-Type: {kind!r}; a JSON route takes 'application/json'",
                         code="unsupported_media_type")
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise P.APIError(413, f"the request body is {size} bytes, above server.max_request_bytes={limit}",
                         code="request_too_large")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise P.APIError(413, f"the request body is above server.max_request_bytes={limit} bytes",
                                     code="request_too_large")
    except TimeoutError:
        logger.warning("request body from %s took longer than server.read_timeout_s=%s", request.client, timeout_s)
        raise P.APIError(408, f"the request body did not arrive within server.read_timeout_s={timeout_s} "
                         f"({len(body)} bytes came)", code="request_timeout") from None
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise P.APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise P.APIError(400, f"the request body is nested too deeply; at most {MAX_JSON_DEPTH} levels") from None
    depth = _depth(data)
    if depth > MAX_JSON_DEPTH:
        raise P.APIError(400, f"the request body is nested {depth} levels deep; at most {MAX_JSON_DEPTH}")
    return data


def _depth(data: Any) -> int:
    """How deep lists and objects nest in ``data`` (walked without recursion)."""
    deepest, todo = 0, [(data, 1)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, (list, dict)):
            deepest = max(deepest, d)
            todo.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))
    return deepest


async def _until_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


_ROUTES = ("GET /v1/models", "GET /v1/models/{id}", "POST /v1/completions", "POST /v1/chat/completions",
           "POST /v1/embeddings", "GET /health", "GET /metrics")


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
    cfg = llm.config.server
    app.add_middleware(Guard, api_key=cfg.api_key, allowed_origins=cfg.allowed_origins, allowed_hosts=cfg.allowed_hosts)

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, exc: P.APIError) -> JSONResponse:
        if exc.status in (400, 404, 413, 415):
            state.metrics.reject("invalid")
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:  # no route, wrong method
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            msg = f"{where}: no such route; the routes are {', '.join(_ROUTES)}"
        elif exc.status_code == 405:
            msg = f"{where}: method not allowed; use {(exc.headers or {}).get('Allow', 'another method')}"
        else:
            msg = f"{where}: {exc.detail}"
        resp = error_response(P.APIError(exc.status_code, msg))
        resp.headers.update(exc.headers or {})
        return resp

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:  # the server's own fault: still an error object
        logger.exception("request %s %s failed", request.method, request.url.path)
        return error_response(P.APIError(500, f"the server failed: {type(exc).__name__}: {exc}", code="server_error"))

    @app.get("/health")
    async def health() -> Response:
        if state.closing:
            return error_response(P.APIError(503, "the server is shutting down", code="shutting_down"))
        serving, body = state.served.health()  # data parallelism: each replica, and "degraded" once one is lost
        return JSONResponse(body, status_code=200 if serving else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict[str, Any]:
        return {"id": state.name, "object": "model", "created": int(time.time()), "owned_by": "corerun",
                "root": state.name, "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        adapters = state.adapters.cards() if state.adapters is not None else []
        return JSONResponse({"object": "list", "data": [model_card(), *adapters]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        if state.adapters is not None and model in state.adapters.by_name:
            return JSONResponse(next(c for c in state.adapters.cards() if c["id"] == model))
        if model != state.name:
            raise P.APIError(404, f"model {model!r} does not exist; this server serves {state.name!r}",
                             param="model", code="model_not_found")
        return JSONResponse(model_card())

    if state.adapters is not None:
        add_lora_routes(app, state.adapters, read_json, state.cfg)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = P.parse_body(P.CompletionRequest, await read_json(request, state.cfg))
        lora = state.check_model(req)
        P.unsupported(req)
        prompts = await asyncio.to_thread(state.completion_prompts, req)  # a long prompt must not stall the others
        params = P.sampling_params(req, default_max_tokens=16, max_logprobs=state.max_logprobs)
        state.check_length(prompts, req.max_tokens, "prompt")
        return await _serve(request, state, req, prompts, params, chat=False, lora=lora)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = P.parse_body(P.ChatCompletionRequest, await read_json(request, state.cfg))
        lora = state.check_model(req)
        P.unsupported(req)
        tools = tool_calls.plan(req, state.parsers)  # sets the structured output of required / named tool_choice
        prompt = await asyncio.to_thread(state.chat_prompt, req, tools.tools if tools else None)
        state.check_length([prompt], None, "messages")
        params = P.sampling_params(req, default_max_tokens=state.default_max_tokens(len(prompt)),
                                   max_logprobs=state.max_logprobs)
        params = tool_calls.with_special_tokens(params, tools)
        state.check_length([prompt], req.max_completion_tokens or req.max_tokens, "messages")
        return await _serve(request, state, req, [prompt], params, chat=True, tools=tools, lora=lora)

    @app.post("/v1/embeddings")
    async def embed(request: Request) -> Response:
        return await _embed(request, state)

    return app


async def _serve(request: Request, state: Serving, req: Any, prompts: list[list[int]], params: Any, chat: bool,
                 tools: tool_calls.ToolPlan | None = None, lora: Any = None) -> Response:
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    streams = await state.submit(prompts, params, rid, final_only=not req.stream, structured=P.structured_field(req),
                                 lora=lora)
    created = int(time.time())
    state.in_flight[rid] = streams
    if req.stream:  # (the stream leaves in_flight when it ends)
        return StreamingResponse(stream(state, req, streams, prompts, rid, created, chat, tools),
                                 media_type="text/event-stream")
    finals = await _finals(request, state, rid, streams)
    if finals is None:
        return Response(status_code=499)  # (nobody reads it: the client is gone)
    for out in finals:
        state.metrics.finished(out)
    err = state.cut_off_error(finals)
    if err is not None:
        return error_response(err)
    return JSONResponse(full_response(state, req, finals, prompts, rid, created, chat, tools))


async def _finals(request: Request, state: Serving, rid: str, streams: list[Any]) -> list[Any] | None:
    """The requests' final outputs; None when the client went away first (its requests are aborted)."""
    collecting = asyncio.ensure_future(collect(streams))
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({collecting, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        state.in_flight.pop(rid, None)
        if not collecting.done():  # the client went away (or this task was cancelled): free the engine
            collecting.cancel()
            state.abort(streams)
    if not collecting.done() or collecting.cancelled():
        return None
    return collecting.result()


async def _embed(request: Request, state: Serving) -> Response:
    req = P.parse_body(embeddings.EmbeddingRequest, await read_json(request, state.cfg))
    state.check_model(req)
    prompts = await asyncio.to_thread(embeddings.prompts_of, state, req)  # a long input must not stall the others
    params = embeddings.params_of(state, req)
    state.check_length(prompts, None, "input")
    rid = "embd-" + uuid.uuid4().hex
    try:
        streams = await state.submit(prompts, params, rid, final_only=True)
    except P.APIError as exc:  # the engine's checks name the prompt; this route's field is input
        if exc.param == "prompt":
            raise P.APIError(400, "input" + exc.message.removeprefix("prompt"), param="input") from None
        raise
    state.in_flight[rid] = streams
    finals = await _finals(request, state, rid, streams)
    if finals is None:
        return Response(status_code=499)
    for out in finals:
        state.metrics.embedded(out)
    err = embeddings.error_of(finals)
    if err is not None:
        return error_response(err)
    return JSONResponse(embeddings.response(state.name, req, finals))
