"""What every route needs: the engine it serves (one LLM or data-parallel replicas) and the tokenizer, the
served name, limits, metrics; turning a request's prompt into token ids, queueing it (or refusing it with 503),
aborting it."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from corerun.errors import ConfigError, EngineClosedError, RequestError
from corerun.server import chat_template
from corerun.lora.request import LoRARequest
from corerun.server import protocol as P
from corerun.server import tool_calls
from corerun.server.metrics import ServerMetrics
from corerun.server.served import served_engine

logger = logging.getLogger("corerun.server")


def model_name(llm: Any) -> str:
    cfg = llm.config
    if cfg.server.served_model_name:
        return cfg.server.served_model_name
    if cfg.model:
        from corerun.models.hub import is_hub_id

        return str(cfg.model) if is_hub_id(str(cfg.model)) else Path(cfg.model).name
    from corerun.models.default import MODEL_NAME

    return MODEL_NAME


def lora_adapters(llm: Any, name: str) -> Any:
    """The server's LoRA adapters (:class:`corerun.server.lora.Adapters`) when the engine has LoRA on, else None."""
    cfg = llm.config
    if not cfg.lora.enabled:
        if cfg.server.lora_modules:
            raise ConfigError("server.lora_modules names adapters but lora.enabled is off; set lora: {enabled: true} "
                              "(corerun serve --lora-modules turns it on)")
        return None
    from corerun.server.lora import Adapters

    return Adapters(llm.engine, name, cfg.server.lora_modules, cfg.server.enable_lora_runtime_updating)


class Serving:
    """What every route needs: the engine it serves (:mod:`corerun.server.served`: one LLM, or data-parallel
    replicas), the tokenizer, the served name, limits, metrics."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.served = served_engine(llm)
        self.tokenizer = self.served.tokenizer
        self.name = model_name(llm)
        self.cfg = llm.config.server
        self.max_model_len = self.served.max_model_len
        self.kv_tokens = self.served.kv_tokens  # the most K/V the cache can ever hold for one request
        if self.kv_tokens < self.max_model_len - 1:
            logger.warning("the KV cache holds %d tokens, less than one request of max_model_len=%d: chat requests "
                           "without max_tokens get at most %d tokens of prompt and output; raise kv_cache.num_blocks "
                           "or memory to serve the whole context", self.kv_tokens, self.max_model_len,
                           self.kv_tokens + 1)
        self.max_logprobs = llm.config.max_logprobs
        self.parsers = tool_calls.choose_parsers(self.cfg, self.tokenizer)
        self.metrics = ServerMetrics(self.served, self.name)
        self.admitting = 0  # requests between the queue check and the engine's waiting queue
        self.closing = False  # shutdown has begun: new requests get 503
        self.cut_off = False  # shutdown_timeout_s has passed: what is still in flight was ended with an error
        self.in_flight: dict[str, list[Any]] = {}  # request id -> its engine streams, while a client waits on them
        self._token_text: dict[int, str] = {}
        self._tasks: set[asyncio.Task] = set()  # recording the ends of aborted requests
        self.adapters = lora_adapters(llm, self.name)  # LoRA adapters served as models (corerun.server.lora)

    # ---------------------------------------------------------------- input
    def check_model(self, req: P._Request) -> LoRARequest | None:
        """The adapter ``req.model`` names (``None``: the base model); 404 for a model this server does not serve."""
        if self.adapters is not None:
            return self.adapters.resolve(req.model)
        if req.model is not None and req.model != self.name:
            raise P.APIError(404, f"model {req.model!r} does not exist; this server serves {self.name!r}",
                             param="model", code="model_not_found")
        return None

    def encode(self, text: str, field: str, special: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise P.APIError(400, f"{field}: this model has no tokenizer, so text cannot be served; send token ids",
                             param=field)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise P.APIError(400, f"{field}: not valid Unicode text (character {exc.start} is a lone surrogate)",
                             param=field) from None
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=special))
        except Exception as exc:  # the tokenizer refusing this text is the request's problem, not a 500
            raise P.APIError(400, f"{field}: the tokenizer failed on it: {type(exc).__name__}: {exc}", param=field) from None

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

    def chat_prompt(self, req: P.ChatCompletionRequest, tools: list[dict[str, Any]] | None = None) -> list[int]:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise P.APIError(400, "messages: this model has no chat template; use /v1/completions", param="messages")
        kwargs = chat_template.check_kwargs(req.chat_template_kwargs)
        messages, tools = tool_calls.for_template(P.chat_text(req.messages), tools, self.parsers)
        if tools:
            kwargs["tools"] = tools
        try:
            text = chat_template.render(tok, messages, add_generation_prompt=req.add_generation_prompt,
                                        kwargs=kwargs, max_chars=self.cfg.chat_template_max_chars,
                                        timeout_s=self.cfg.chat_template_timeout_s)
        except P.APIError:
            raise
        except chat_template.TemplateLimit as exc:
            logger.warning("chat template stopped: %s", exc)
            raise P.APIError(400, f"messages: {exc}", param="messages") from None
        except Exception as exc:  # a template raising on these messages (e.g. roles out of order)
            raise P.APIError(400, f"messages: the chat template refused them: {type(exc).__name__}: {exc}",
                             param="messages") from None
        return self.encode(text, "messages", special=False)  # the template wrote the special tokens

    def default_max_tokens(self, prompt_len: int) -> int:
        """vLLM's default for a request without ``max_tokens``: the rest of the context, capped by what the KV
        cache can ever hold (a request keeps ``prompt + max_tokens - 1`` tokens of K/V)."""
        return max(1, min(self.max_model_len - prompt_len, self.kv_tokens + 1 - prompt_len))

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
    async def submit(self, prompts: list[list[int]], params: Any, prefix: str, final_only: bool = False,
                     structured: str | None = None, lora: LoRARequest | None = None) -> list[Any]:
        """Queue one engine request per prompt (all or none); 503 when the waiting queue is full. With
        ``final_only`` (a non-streamed answer) the engine loop sends each request's last output only;
        ``structured`` is the field the request constrained its output with (named by compile errors)."""
        if self.closing:
            raise P.APIError(503, "the server is shutting down", code="shutting_down")
        waiting = self.served.num_waiting() + self.admitting
        if waiting + len(prompts) > self.cfg.max_waiting_requests:
            self.metrics.reject("overloaded")
            raise P.APIError(503, f"the server is overloaded: {waiting} requests are waiting (server."
                             f"max_waiting_requests={self.cfg.max_waiting_requests}); retry later", code="overloaded")
        streams: list[Any] = []
        self.admitting += len(prompts)
        try:
            for i, ids in enumerate(prompts):
                streams.append(await self.served.add_request_async(ids, params, request_id=f"{prefix}-{i}",
                                                                   final_only=final_only, lora_request=lora))
        except RequestError as exc:
            self.abort(streams, record=False)
            param = _param_of(str(exc))
            raise P.APIError(400, str(exc), param=structured if param == "structured_outputs" else param) from None
        except EngineClosedError:
            self.abort(streams, record=False)
            raise P.APIError(503, "the server is shutting down", code="shutting_down") from None
        except BaseException:
            self.abort(streams, record=False)
            raise
        finally:
            self.admitting -= len(prompts)
        return streams

    def begin_shutdown(self, timeout_s: float) -> None:
        """Shutdown has begun (called on the server's loop): refuse new requests now, and after ``timeout_s``
        end every request still in flight with an explicit error to its client (see ``cut_off_error``)."""
        self.closing = True
        asyncio.get_running_loop().call_later(timeout_s, self._cut_off, timeout_s)

    def _cut_off(self, timeout_s: float) -> None:
        self.cut_off = True
        for rid, streams in list(self.in_flight.items()):
            logger.warning("shutdown: %s cut off after server.shutdown_timeout_s=%s", rid, timeout_s)
            self.abort(streams, record=False)  # its handler reads the abort outputs (and records them)

    def cut_off_error(self, outputs: list[Any]) -> P.APIError | None:
        """The 503 for a client whose request shutdown ended (its outputs finished as ``abort``), else None."""
        if self.cut_off and any(c.finish_reason == "abort" for out in outputs for c in out.outputs):
            return P.APIError(503, "the server is shutting down: this request was still running when "
                              "server.shutdown_timeout_s ran out, and was ended; retry it", code="shutting_down")
        return None

    def abort(self, streams: list[Any], record: bool = True) -> None:
        """Abort the requests not finished yet; with ``record``, their final (``abort``) outputs still go to /metrics."""
        left = [s for s in streams if not s.finished]
        if not left:
            return
        try:
            self.served.abort([s.request_id for s in left], wait=False)
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
    if head.startswith("structured_outputs"):  # a grammar, schema or regex that does not compile
        return "structured_outputs"
    for name in ("logit_bias", "stop_token_ids", "stop", "logprobs", "max_tokens", "min_tokens", "temperature", "top_p",
                 "top_k", "seed"):
        if name in message:
            return name
    return None
