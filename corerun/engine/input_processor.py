"""Input processing: a request is validated, tokenised and checked to fit before it is queued.

Everything here reads the configuration, the model's limits and the sampler's checks; a request that
is wrong is refused with a :class:`~corerun.errors.RequestError` naming what was wrong, the value and
what would be right, and nothing is queued.
"""

from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence as Seq

from pydantic import ValidationError

from corerun.core.sequence import Sequence
from corerun.errors import RequestError, UnsupportedError
from corerun.lora.request import LoRARequest
from corerun.sampling_params import SamplingParams

logger = logging.getLogger("corerun.engine")

Prompt = str | Seq[int]


@dataclass(frozen=True)
class Limits:
    """What a request must fit: the model's, the cache's and the scheduler's limits."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    max_logprobs: int
    max_num_batched_tokens: int
    chunked_prefill: bool

    @classmethod
    def of(cls, config: Any, model_config: Any, kv: Any, max_num_batched_tokens: int) -> Limits:
        """The limits of ``config``, the model's config, the KV-cache manager's blocks and the step's token
        budget (``scheduler.max_num_batched_tokens`` resolved for the device: ``ModelRunner.max_num_batched_tokens``)."""
        sc = config.scheduler
        return cls(
            max_model_len=model_config.max_model_len if sc.max_model_len == "auto" else sc.max_model_len,
            vocab_size=model_config.vocab_size, block_size=kv.block_size, num_blocks=kv.num_blocks,
            max_logprobs=config.max_logprobs, max_num_batched_tokens=max_num_batched_tokens,
            chunked_prefill=sc.chunked_prefill,
        )


class InputProcessor:
    """Turns ``(prompt, params, request_id)`` into a :class:`Sequence`, or refuses it.

    ``check_params(params)`` is the sampler's and the logits processors' check (raising
    ``UnsupportedError`` / ``ValueError`` for what they cannot honour, anything else for a failure).
    """

    def __init__(self, limits: Limits, tokenizer: Any, check_params: Callable[[SamplingParams], None],
                 check_lora: Callable[[LoRARequest], Any] | None = None) -> None:
        self.limits = limits
        self.tokenizer = tokenizer
        self.check_params = check_params
        self.check_lora = check_lora  # loads and checks an adapter (corerun.lora); None: LoRA is off

    def process(self, prompt: Prompt, params: SamplingParams | dict | None, seq_id: int, request_id: str,
                lora: LoRARequest | None = None) -> Sequence:
        """Validate one request and build its Sequence (not queued); ``lora``: the adapter it runs under,
        read and checked against the model now (a mismatch is refused here, never in a step)."""
        params = _params(params)
        if lora is not None:
            if not isinstance(lora, LoRARequest):
                raise RequestError(f"lora_request must be a LoRARequest(lora_name, lora_int_id, lora_path), got "
                                   f"{type(lora).__name__}")
            if self.check_lora is None:
                raise RequestError(f"lora_request {lora.lora_name!r} given, but LoRA is off; start the engine with "
                                   "lora: {enabled: true} (LLM(..., lora={'enabled': True}))")
            self.check_lora(lora)
        text, token_ids = self.tokenize(prompt)
        lim = self.limits
        n = len(token_ids)
        if n >= lim.max_model_len:
            raise RequestError(
                f"prompt has {n} tokens, but max_model_len is {lim.max_model_len}: "
                f"it must be shorter, to leave room for at least one generated token"
            )
        try:
            params.check_vocab(lim.vocab_size)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        if params.stop and self.tokenizer is None:
            raise RequestError(f"stop={list(params.stop)!r}: stop strings need a tokenizer, and this engine has none; "
                               "use stop_token_ids instead")
        for field in ("logprobs", "prompt_logprobs"):
            k = getattr(params, field)
            if k is not None and k > lim.max_logprobs:
                raise RequestError(f"{field}={k} is above this engine's max_logprobs={lim.max_logprobs}")
            if k is not None and k > lim.vocab_size:
                raise RequestError(f"{field}={k} is above the model's vocabulary size {lim.vocab_size}")
        self.check_fits(n, params)
        self.check_params(params)
        return Sequence(
            seq_id=seq_id, request_id=request_id, prompt_token_ids=token_ids, params=params, prompt=text,
            arrival_time=time.perf_counter(), lora=lora,
        )

    def check_fits(self, n: int, params: SamplingParams) -> None:
        """Refuse a request that could never be scheduled, however long it waited.

        Its K/V never exceed ``n + max_tokens - 1`` tokens (the last sampled token is not fed back),
        capped at ``max_model_len - 1``; without chunked prefill a recompute after preemption must
        also fit in one step's token budget.
        """
        lim = self.limits
        bs, blocks = lim.block_size, lim.num_blocks
        longest = min(n + params.max_tokens, lim.max_model_len) - 1
        need = -(-longest // bs)
        if n > blocks * bs:
            raise RequestError(
                f"the prompt alone ({n} tokens) needs {-(-n // bs)} KV-cache blocks of {bs}, but the whole cache "
                f"has {blocks}; shorten the prompt or raise kv_cache.num_blocks / memory"
            )
        if need > blocks:
            raise RequestError(
                f"request needs up to {need} KV-cache blocks ({n} prompt + {params.max_tokens} max_tokens, "
                f"block size {bs}) but the whole cache has {blocks}; lower max_tokens to at most "
                f"{blocks * bs + 1 - n} or raise kv_cache.num_blocks / memory"
            )
        if not lim.chunked_prefill and longest > lim.max_num_batched_tokens:
            raise RequestError(
                f"request may need {longest} tokens computed in one step ({n} prompt + {params.max_tokens} "
                f"max_tokens, recomputed whole after a preemption) but scheduler.max_num_batched_tokens is "
                f"{lim.max_num_batched_tokens} and chunked_prefill is off; shorten the request, raise "
                f"max_num_batched_tokens, or turn chunked_prefill on"
            )

    def tokenize(self, prompt: Prompt) -> tuple[str | None, tuple[int, ...]]:
        """``(text or None, token ids)``; every id checked against the model's vocabulary, however it was produced."""
        text = None
        if isinstance(prompt, dict):  # vLLM's {"prompt": text} / {"prompt_token_ids": ids}
            unknown = sorted(map(str, set(prompt) - {"prompt", "prompt_token_ids"}))
            if unknown or not prompt:
                raise RequestError(
                    f"a prompt given as a dict takes 'prompt' (text) or 'prompt_token_ids' (token ids), "
                    f"got keys {sorted(map(str, prompt))}"
                )
            prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
        if isinstance(prompt, str):
            text, prompt = prompt, self._encode(prompt)
        if isinstance(prompt, (bytes, bytearray)):
            raise RequestError("prompt is bytes; give a string or a list of token ids")
        if hasattr(prompt, "tolist") and getattr(prompt, "ndim", 1) == 1:  # numpy array / torch tensor
            prompt = prompt.tolist()
        vocab = self.limits.vocab_size
        try:
            ids = list(prompt)
        except TypeError:
            raise RequestError(
                f"prompt must be a string or a list of token ids (integers in [0, {vocab})), got {type(prompt).__name__}"
            ) from None
        if not ids:
            raise RequestError("prompt is empty; give at least one token")
        for i, t in enumerate(ids):
            try:
                if isinstance(t, (bool, float, str, bytes)):
                    raise TypeError
                t = operator.index(t)
            except TypeError:
                raise RequestError(
                    f"prompt token {i} is {t!r} ({type(t).__name__}); token ids must be integers in [0, {vocab})"
                ) from None
            if not 0 <= t < vocab:
                if text is not None:  # a tokenizer that does not match the model: refuse here, not in the step
                    raise RequestError(
                        f"the tokenizer turned the prompt into token {t} (position {i}), outside the model's "
                        f"vocabulary [0, {vocab}): the tokenizer files do not match the model's vocab_size"
                    )
                raise RequestError(f"prompt token {i} is {t}, outside the vocabulary: token ids must be in [0, {vocab})")
            ids[i] = t
        return text, tuple(ids)  # the request's prompt for good (Sequence.prompt_token_ids)

    def _encode(self, text: str) -> list[int]:
        if not text:
            raise RequestError("prompt is empty; give at least one token")
        if self.tokenizer is None:
            raise RequestError(
                "prompt is text, but this engine has no tokenizer (model folder without tokenizer files, "
                "or skip_tokenizer_init); pass token ids instead"
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(
                f"prompt is not valid Unicode text: character {exc.start} is a lone surrogate "
                f"({text[exc.start]!r}); give UTF-8 encodable text"
            ) from None
        try:
            return list(self.tokenizer.encode(text))
        except Exception as exc:
            raise RequestError(f"the tokenizer failed on the prompt: {type(exc).__name__}: {exc}") from None


def sampler_check(sampler: Any, sampler_name: str, procs: Any) -> Callable[[SamplingParams], None]:
    """The check of :class:`InputProcessor`: ``sampler.check``, then the logits processors a request
    wants, compiled now (cached), never inside a step."""

    def check(params: SamplingParams) -> None:
        if params.pooling is not None:  # an embedding request: never sampled, so the sampler has no say
            _check_pooling(params)
            return
        try:
            sampler.check(params)
        except (UnsupportedError, ValueError) as exc:
            raise RequestError(str(exc)) from None
        except Exception as exc:
            raise RequestError(
                f"sampler '{sampler_name}' failed checking the sampling parameters: {type(exc).__name__}: {exc}"
            ) from exc
        if procs.wanted(params):
            try:
                procs.prepare(params)
            except (UnsupportedError, ValueError) as exc:
                raise RequestError(str(exc)) from None
            except Exception as exc:  # a processor that cannot be built here (PluginLoadError, ...)
                raise RequestError(f"structured output cannot be served: {type(exc).__name__}: {exc}") from exc

    return check


def _params(params: SamplingParams | dict | None) -> SamplingParams:
    params = params if params is not None else SamplingParams()
    if isinstance(params, dict):
        try:
            params = SamplingParams(**params)
        except ValidationError as exc:
            raise RequestError(f"invalid sampling_params: {_validation_details(exc)}") from None
    if not isinstance(params, SamplingParams):
        raise RequestError(f"sampling_params must be a SamplingParams (or a dict of its fields), got {type(params).__name__}")
    return params


def _validation_details(exc: ValidationError) -> str:
    """``field: message (got value)`` for each problem pydantic found, on one line."""
    parts = []
    for e in exc.errors():
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown field; SamplingParams has {', '.join(SamplingParams.model_fields)}"
        elif e["loc"] and "got " not in msg:
            msg += f" (got {e.get('input')!r})"
        parts.append(f"{'.'.join(map(str, e['loc']))}: {msg}" if e["loc"] else msg)
    return "; ".join(parts)


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer in ``model_dir`` (transformers), or None when it has no tokenizer files."""
    files = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if not any((model_dir / f).exists() for f in files):
        logger.info("no tokenizer files in %s: prompts must be token ids, outputs carry no text", model_dir)
        return None
    from corerun.models.errors import ModelLoadError

    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ModelLoadError(
            f"the tokenizer in {model_dir} needs transformers, which cannot be imported ({exc}): "
            "pip install 'corerun[hf]', or set skip_tokenizer_init: true and pass token ids"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # corrupt tokenizer.json, a bad tokenizer_config.json, ...
        present = [f for f in files if (model_dir / f).exists()]
        raise ModelLoadError(
            f"cannot load the tokenizer in {model_dir} ({', '.join(present)}): {type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:300] if str(exc) else ''}; fix or remove these files, or set "
            "skip_tokenizer_init: true and pass token ids"
        ) from None


def _check_pooling(params: SamplingParams) -> None:
    """An embedding request computes its prompt and nothing else: no sampling field may be set."""
    extra = sorted(params.non_default_fields() - {"pooling", "max_tokens"})
    if params.max_tokens != 1 or extra:
        raise RequestError(f"an embedding request (pooling set) samples nothing; it takes max_tokens=1 and no "
                           f"sampling fields, got max_tokens={params.max_tokens}, fields {extra}")
