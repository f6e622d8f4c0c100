"""``SamplingParams``: vLLM's names and validation rules, as a pydantic model."""

from __future__ import annotations

import math
import warnings
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Upper bound on ``logprobs`` / ``prompt_logprobs`` (vLLM's ``max_logprobs`` default).
MAX_LOGPROBS = 20
# Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``): dividing logits by them overflows.
SAMPLING_EPS = 1e-5
# Samplers compute in float32: a finite Python float past these bounds would reach them as inf or 0
# (a bias of -1e300 is -inf, a ban that dodges the "not every token" rule; a repetition penalty of
# 1e-300 is 0, a division by zero). Within them, logits stay finite through every stage.
MAX_LOGIT_BIAS = 1e6
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
MAX_TEMPERATURE = 1e6
# Upper bound on ``n`` (samples of one request); each is a sequence of its own in the scheduler.
MAX_N = 128
# Upper bounds on ``stop``: every stop string is looked for in every request's new text each step.
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_LEN = 1024  # characters


POOLING_TYPES = ("last", "mean", "cls")


class PoolingParams(BaseModel):
    """How an embedding request turns its prompt's final hidden states into one vector.

    - ``pooling_type``: ``last`` (the last token's state), ``mean`` (the average over the prompt) or
      ``cls`` (the first token's state).
    - ``normalize``: divide the vector by its L2 norm.
    - ``dimensions``: keep only the first ``dimensions`` values (before normalising; a model trained for
      it, Matryoshka, is needed for the result to mean anything: the engine checks that).

    A request carrying one (``SamplingParams.pooling``) is computed as a prompt only: no token is sampled,
    and it finishes when its prompt is computed.  See docs/usage.md, *Embeddings*.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    pooling_type: str = "last"
    normalize: bool = True
    dimensions: int | None = Field(None, ge=1)

    @field_validator("pooling_type")
    @classmethod
    def _known_type(cls, v: str) -> str:
        if v not in POOLING_TYPES:
            raise ValueError(f"pooling_type {v!r} is not one of {list(POOLING_TYPES)}")
        return v


with warnings.catch_warnings():  # the field `json` (vLLM's name) shadows pydantic's deprecated BaseModel.json()
    warnings.filterwarnings("ignore", message='Field name "json"', category=UserWarning)

    class _StructuredOutputsBase(BaseModel):
        json: dict[str, Any] | str | None = None


class StructuredOutputsParams(_StructuredOutputsBase):
    """Constrain the output to a language, vLLM's names; exactly one field is set.

    - ``json``: a JSON schema (a dict, or a string holding one); the output is a JSON value it validates.
    - ``json_object``: ``True``: any JSON object.
    - ``regex``: the output matches this regular expression (whole output).
    - ``choice``: the output is one of these strings.
    - ``grammar``: an EBNF grammar (GBNF-like, rule ``root`` is the start).

    Served by a logits processor (``corerun-structured-output``); see docs/structured-output.md.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    @field_validator("json", mode="before")
    @classmethod
    def _json(cls, v: Any) -> Any:
        if isinstance(v, str):
            import json as _json

            try:
                parsed = _json.loads(v)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json must be a JSON schema, got a string that is not JSON: {exc}") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {type(parsed).__name__}")
        elif v is not None and not isinstance(v, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or a JSON string), got {type(v).__name__}")
        return v

    @field_validator("choice", mode="before")
    @classmethod
    def _choice(cls, v: Any) -> Any:
        if v is None:
            return v
        if isinstance(v, str) or not isinstance(v, (list, tuple)) or not all(isinstance(c, str) for c in v):
            raise ValueError(f"structured_outputs.choice must be a list of strings, got {v!r}")
        if not v or any(not c for c in v):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got {list(v)!r}")
        return tuple(v)

    @field_validator("regex", "grammar")
    @classmethod
    def _text(cls, v: str | None, info: Any) -> str | None:
        if v is not None and not v.strip():
            raise ValueError(f"structured_outputs.{info.field_name} must be a non-empty string")
        return v

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputsParams":
        set_ = [k for k in type(self).model_fields if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, grammar; "
                f"got {', '.join(set_) if set_ else 'none'}"
            )
        return self

    @model_validator(mode="after")
    def _valid_unicode(self) -> "StructuredOutputsParams":
        import json as _json

        kind, value = self.kind, getattr(self, self.kind)
        if kind == "choice":
            named = [(f"choice[{i}]", c) for i, c in enumerate(value)]
        else:
            named = [(kind, value if isinstance(value, str) else _json.dumps(value, ensure_ascii=False))]
        for name, text in named:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate: no UTF-8 text (nor grammar) holds it
                where = f" at character {exc.start}" if kind != "json" or isinstance(value, str) else ""
                raise ValueError(
                    f"structured_outputs.{name} must be valid Unicode text, got a lone surrogate {text[exc.start]!r}{where}"
                ) from None
        return self

    @property
    def kind(self) -> str:
        """The one field that is set: ``json``, ``json_object``, ``regex``, ``choice`` or ``grammar``."""
        return next(k for k in type(self).model_fields if getattr(self, k) not in (None, False))


class SamplingParams(BaseModel):
    """How to pick each next token of one request.

    ``temperature == 0`` (or below ``SAMPLING_EPS``, as in vLLM) means greedy.  A ``logit_bias`` of
    ``-inf`` bans a token.  Every field keeps vLLM's meaning; a bad value raises
    ``pydantic.ValidationError`` (a ``ValueError``) naming the field and the value.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    n: int = Field(1, ge=1, le=MAX_N)  # samples per prompt (the engine forks them from one prefill)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: the output ends before the first one (corerun.engine.stop_strings)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # the output text leaves out the tokenizer's special tokens (vLLM's meaning)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    # the output follows a JSON schema, regex, choice or grammar (a logits processor masks the logits)
    structured_outputs: StructuredOutputsParams | None = None
    # an embedding request: its prompt is pooled into one vector and nothing is sampled (LLM.embed)
    pooling: PoolingParams | None = None

    @field_validator(
        "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
        mode="before",
    )
    @classmethod
    def _not_bool(cls, v: Any, info: Any) -> Any:
        if isinstance(v, bool):  # pydantic would read True as 1 / 1.0
            raise ValueError(f"{info.field_name} must be a number, got {v!r}")
        return v

    @field_validator("stop_token_ids", "logit_bias", mode="before")
    @classmethod
    def _no_bool_ids(cls, v: Any, info: Any) -> Any:
        ids = list(v.keys()) if isinstance(v, dict) else list(v or ())
        bad = [t for t in ids if isinstance(t, bool)]
        if bad:  # pydantic would read True as token 1
            raise ValueError(f"{info.field_name} must hold integer token ids, got {bad[0]!r}")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None:
            return ()
        if isinstance(v, str):  # one stop string, as OpenAI's API allows
            v = (v,)
        if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) for s in v):
            raise ValueError(f"stop must be a string or a list of strings, got {v!r}")
        if any(not s for s in v):
            raise ValueError(f"stop strings must be non-empty, got {list(v)!r}")
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(v)}")
        longest = max(range(len(v)), key=lambda i: len(v[i]), default=0)
        if v and len(v[longest]) > MAX_STOP_STRING_LEN:
            raise ValueError(
                f"stop strings may be at most {MAX_STOP_STRING_LEN} characters long, got {len(v[longest])} "
                f"(stop[{longest}])"
            )
        return tuple(v)

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {v}")
        if v > MAX_TEMPERATURE:
            raise ValueError(f"temperature must be <= {MAX_TEMPERATURE:g} (sampling computes in float32), got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not (0.0 < v <= 1.0):  # NaN fails too
            raise ValueError(f"top_p must be in (0, 1], got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {v}")
        return 0 if v == -1 else v

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, v: float) -> float:
        if not (0.0 <= v <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {v}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float, info: Any) -> float:
        if not (-2.0 <= v <= 2.0):
            raise ValueError(f"{info.field_name} must be in [-2, 2], got {v}")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition(cls, v: float) -> float:
        if not (math.isfinite(v) and v > 0.0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), got {v}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= v <= hi:
            raise ValueError(
                f"repetition_penalty must be in [{lo:g}, {hi:g}] (sampling computes in float32; 1 disables it), got {v}"
            )
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not (-(2**63) <= v < 2**64):
            raise ValueError(f"seed must be a 64-bit integer in [-2**63, 2**64), got {v}")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"max_tokens must be >= 1, got {v}")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"min_tokens must be >= 0, got {v}")
        return v

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _logprobs(cls, v: int | None, info: Any) -> int | None:
        if v is not None and not (0 <= v <= MAX_LOGPROBS):
            raise ValueError(f"{info.field_name} must be between 0 and {MAX_LOGPROBS}, got {v}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        bad = [t for t in v if t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {bad}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if not v:  # {} is no bias: the default, so samplers without logit_bias accept it
            return None
        for tok, bias in v.items():
            if tok < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {tok}")
            if math.isnan(bias) or bias == math.inf:
                raise ValueError(f"logit_bias values must be finite, or -inf to ban a token, got {bias} for token {tok}")
            if bias != -math.inf and abs(bias) > MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must be within +-{MAX_LOGIT_BIAS:g} (sampling computes in float32), or -inf "
                    f"to ban a token, got {bias} for token {tok}"
                )
        return v

    @model_validator(mode="after")
    def _min_le_max(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        """Whether this request takes the most likely token (``temperature < SAMPLING_EPS``)."""
        return self.temperature < SAMPLING_EPS

    def check_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: token ids in ``logit_bias`` and ``stop_token_ids`` inside the vocabulary."""
        for field, ids in (("logit_bias", list(self.logit_bias or ())), ("stop_token_ids", list(self.stop_token_ids))):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{field} has token ids outside the vocabulary [0, {vocab_size}): {bad}")
        banned = sum(1 for bias in (self.logit_bias or {}).values() if bias == -math.inf)
        if banned >= vocab_size:
            raise ValueError(f"logit_bias bans all {vocab_size} tokens of the vocabulary (-inf); at least one must stay")

    def non_default_fields(self) -> set[str]:
        """Sampling fields set away from their no-op value (what a sampler must honour)."""
        return {name for name, field in type(self).model_fields.items() if getattr(self, name) != field.default}
