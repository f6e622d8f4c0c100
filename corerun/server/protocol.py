"""OpenAI's request bodies as pydantic models, and their mapping onto ``SamplingParams``.

Unknown fields are refused (a typo like ``max_token`` must not be silently ignored); the fields an
OpenAI client may send that mean nothing here (``user``, ``store``, ...) are accepted and ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from corerun.sampling_params import SamplingParams


class APIError(Exception):
    """An error answered as OpenAI's error object: ``status``, ``message``, ``type``, ``param`` (the field), ``code``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


async def send_error(send: Any, err: APIError, headers: list[tuple[bytes, bytes]] = ()) -> None:  # type: ignore[assignment]
    """Answer ``err`` on a raw ASGI ``send`` (for guards that run before any route)."""
    data = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers]})
    await send({"type": "http.response.body", "body": data})


_TYPES = {403: "permission_error", 404: "not_found_error", 503: "service_unavailable_error"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Request(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's, and vLLM's sampling extensions).

    Strict, as OpenAI is: ``"3"`` or ``2.0`` is not an integer, ``"true"`` not a boolean."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # structured output (docs/structured-output.md): vLLM's field, and its older guided_* spellings
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted and ignored (OpenAI bookkeeping)
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


# OpenAI field -> SamplingParams field, where the names differ
_RENAMED = {"max_completion_tokens": "max_tokens"}


def parse_body(cls: type[_Request], data: Any) -> _Request:
    """Validate a JSON body; the first problem raises ``APIError(400)`` naming its field."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise _field_error(exc, data) from None


def _field_error(exc: ValidationError, data: Any = None) -> APIError:
    e = exc.errors()[0]
    field = ".".join(str(p) for p in e["loc"] if not str(p).startswith(("function-", "list[", "str", "int")))
    field = field or ".".join(map(str, e["loc"]))
    msg = e["msg"].removeprefix("Value error, ")
    top = field.split(".")[0]
    if not e["loc"]:  # a check across fields: its message names them
        return APIError(400, msg, param=msg.split(" ", 1)[0] if msg[:1].isalpha() else None)
    if e["type"] == "extra_forbidden":
        msg = "unknown field"
    elif top in _SHAPES and len(e["loc"]) > 1:  # a union: pydantic reports each member, say what is allowed
        msg = f"must be {_SHAPES[top]}"
        field, e = top, {**e, "input": data.get(top) if isinstance(data, dict) else e.get("input")}
    value = e.get("input")
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    if "got " in msg:
        return APIError(400, f"{field}: {msg.removeprefix(field + ' ')}", param=top or None)
    return APIError(400, f"{field}: {msg} (got {shown})", param=top or None)


_SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "input": "a string, a list of strings, a list of token ids, or a list of lists of token ids",
}


def unsupported(req: _Request) -> None:
    """Refuse, with 400, fields this server accepts in form but does not implement."""
    checks: list[tuple[str, bool]] = []
    if isinstance(req, CompletionRequest):
        checks += [("echo", req.echo), ("suffix", req.suffix is not None),
                   ("best_of", req.best_of is not None and req.best_of != req.n)]
    else:
        assert isinstance(req, ChatCompletionRequest)
        checks += [("response_format", bool(req.response_format)
                    and req.response_format.get("type") not in ("text", "json_object", "json_schema"))]
    for field, bad in checks:
        if bad:
            raise APIError(400, f"{field}: not supported by this server", param=field)


def sampling_params(req: _Request, *, default_max_tokens: int, max_logprobs: int) -> SamplingParams:
    """The request's sampling fields as ``SamplingParams``; a bad value raises ``APIError(400)`` naming the field."""
    fields: dict[str, Any] = {"n": req.n, "ignore_eos": req.ignore_eos, "min_tokens": req.min_tokens,
                              "include_stop_str_in_output": req.include_stop_str_in_output}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "stop"):
        v = getattr(req, name)
        if v is not None:
            fields[name] = v
    if req.stop_token_ids:
        fields["stop_token_ids"] = tuple(req.stop_token_ids)
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    fields["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
    if req.logit_bias:
        bias = {}
        for k, v in req.logit_bias.items():
            try:
                bias[int(k)] = v
            except ValueError:
                raise APIError(400, f"logit_bias: keys must be token ids (integers as strings), got {k!r}",
                               param="logit_bias") from None
        fields["logit_bias"] = bias
    if isinstance(req, CompletionRequest):
        if req.logprobs is not None:
            fields["logprobs"] = req.logprobs
    else:
        assert isinstance(req, ChatCompletionRequest)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
        if req.logprobs:
            fields["logprobs"] = req.top_logprobs or 0
    structured = _structured_outputs(req)
    if structured is not None:
        fields["structured_outputs"] = structured
    k = fields.get("logprobs")
    if k is not None and k > max_logprobs:
        name = "logprobs" if isinstance(req, CompletionRequest) else "top_logprobs"
        raise APIError(400, f"{name}: {k} is above this server's max_logprobs={max_logprobs}", param=name)
    try:
        return SamplingParams(**fields)
    except ValidationError as exc:
        err = _field_error(exc)
        if isinstance(req, ChatCompletionRequest) and err.param == "logprobs":
            err.param = "top_logprobs"
            err.message = "top_logprobs" + err.message.removeprefix("logprobs")
        if err.param == "max_tokens" and isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
            err.param = "max_completion_tokens"
            err.message = "max_completion_tokens" + err.message.removeprefix("max_tokens")
        return _raise(err)


def structured_field(req: _Request) -> str | None:
    """The field the request constrains its output with (``guided_regex``, ``response_format``, ...), if any."""
    return next(iter(_structured_given(req)), None)


def _structured_outputs(req: _Request) -> dict[str, Any] | None:
    """``structured_outputs`` from whichever of its spellings the request uses (at most one)."""
    given = _structured_given(req)
    if len(given) > 1:
        raise APIError(400, f"{', '.join(given)}: set only one way of constraining the output", param=next(iter(given)))
    return next(iter(given.values()), None)


def _structured_given(req: _Request) -> dict[str, dict[str, Any]]:
    given: dict[str, dict[str, Any]] = {}
    if req.structured_outputs is not None:
        given["structured_outputs"] = req.structured_outputs
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            given[name] = {key: getattr(req, name)}
    fmt = getattr(req, "response_format", None) or {}
    if fmt.get("type") == "json_object":
        given["response_format"] = {"json_object": True}
    elif fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.json_schema.schema: must be a JSON schema (an object)",
                           param="response_format")
        given["response_format"] = {"json": schema}
    return given


def _raise(err: APIError) -> Any:
    raise err


def chat_text(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as a chat template expects them: content parts of type ``text`` joined into one string."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages.{i}.content.{j}: only text parts are supported, got type "
                                   f"{part.get('type')!r}", param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        d = {k: v for k, v in (m.model_extra or {}).items()}
        d.update(role=m.role, content=content if content is not None else "")
        out.append(d)
    return out


FinishReason = Literal["stop", "length", "abort", "error"]
