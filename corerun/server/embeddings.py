"""``POST /v1/embeddings``: OpenAI's request and response, served by embedding requests on the engine
loop (pooled prompts, nothing sampled; see corerun.engine.pooling)."""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from corerun.engine.pooling import embedding_params
from corerun.errors import RequestError
from corerun.server import protocol as P


class EmbeddingRequest(BaseModel):
    """OpenAI's fields: ``input`` as a string, strings, token ids or lists of token ids."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


def prompts_of(state: Any, req: EmbeddingRequest) -> list[list[int]]:
    """``input`` as token-id lists (text through the tokenizer); 400 naming ``input`` when empty."""
    given = req.input
    if isinstance(given, str):
        prompts = [state.encode(given, "input")]
    elif given and all(isinstance(x, int) for x in given):
        prompts = [list(given)]  # type: ignore[arg-type]
    else:
        prompts = [state.encode(x, "input") if isinstance(x, str) else list(x) for x in given]
    if not prompts or any(not p for p in prompts):
        raise P.APIError(400, "input: must not be empty (nor hold an empty string or list)", param="input")
    return prompts


def params_of(state: Any, req: EmbeddingRequest) -> Any:
    """The embedding requests' parameters: the model's pooling, ``dimensions`` checked against it."""
    try:
        return embedding_params(state.served.model_pooling, req.dimensions)
    except RequestError as exc:
        raise P.APIError(400, str(exc), param="dimensions") from None


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """``float``: the list as it is; ``base64``: little-endian float32 bytes in base64 (OpenAI's)."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def response(name: str, req: EmbeddingRequest, finals: list[Any]) -> dict[str, Any]:
    tokens = sum(len(out.prompt_token_ids) for out in finals)
    return {
        "object": "list",
        "model": name,
        "data": [{"object": "embedding", "index": i, "embedding": encode_vector(out.outputs.embedding, req.encoding_format)}
                 for i, out in enumerate(finals)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def error_of(finals: list[Any]) -> P.APIError | None:
    """The error for inputs that ended without a vector: 503 when shutdown ended them (the only abort
    that still has a client to answer), else a 500 naming the first (an error in its step)."""
    if any(out.finish_reason == "abort" for out in finals):
        return P.APIError(503, "the server is shutting down: this embedding request was still running when "
                          "server.shutdown_timeout_s ran out, and was ended; retry it", code="shutting_down")
    for i, out in enumerate(finals):
        if out.finish_reason != "stop":
            return P.APIError(500, f"input {i}: the embedding request ended with {out.finish_reason}: {out.error}",
                              code="server_error")
    return None
