"""``XGrammarProcessor``: ``structured_outputs`` as a token bitmask per row (xgrammar), applied before the sampler.

- ``prepare`` (admission) compiles the request's grammar, or takes it from a cache keyed by the
  tokenizer and the spec; a spec xgrammar refuses raises ``ValueError`` with xgrammar's message.
- ``add_request`` makes a ``GrammarMatcher`` per key (per sample), advanced over tokens already made.
- ``apply`` fills the rows' bitmasks on the host and masks the logits (-inf where the grammar forbids);
  on CUDA the bitmask goes through pinned memory, so nothing waits for the device.
- ``accept`` advances each matcher; ``"stop"`` once the grammar has ended (its stop token accepted).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any, ClassVar, Sequence

import torch
import xgrammar as xgr

from corerun.sdk import LogitsProcessorCapabilities
from corerun.sampling_params import SamplingParams, StructuredOutputsParams

from corerun_structured_output.plugin import CAPABILITIES

CACHE_SIZE = 512  # compiled grammars kept (least recently used goes first)
_cache: OrderedDict[tuple, Any] = OrderedDict()  # (tokenizer key, kind, spec) -> xgr.CompiledGrammar
_cache_lock = threading.Lock()
_LOCATION = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")  # xgrammar's "[18:25:15] /project/cpp/x.cc:94: " prefix


def compiler_message(exc: BaseException) -> str:
    """xgrammar's error without its source location."""
    lines = [_LOCATION.sub("", line).strip() for line in str(exc).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__


def spec_text(so: StructuredOutputsParams) -> tuple[str, str]:
    """``(kind, text)``: what is compiled, as a string (the cache key's second half)."""
    kind = so.kind
    if kind == "json":
        value = so.json
        # property order is kept: it is the output's
        return kind, value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if kind == "json_object":
        return kind, '{"type": "object"}'
    if kind == "choice":
        # an EBNF alternative of JSON-escaped literals (xgrammar's string escapes are JSON's, but a
        # "\ud83d\ude00" pair would be read as two lone surrogates): characters past ASCII stay as they are
        return kind, "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice or ())
    return kind, getattr(so, kind)


class XGrammarProcessor:
    """One per engine (per tokenizer); every request using ``structured_outputs`` holds a matcher here."""

    name: ClassVar[str] = "xgrammar"
    capabilities: ClassVar[LogitsProcessorCapabilities] = CAPABILITIES
    needs_tokenizer: ClassVar[bool] = True  # (the conformance suite hands it the default model's)

    def __init__(
        self, vocab_size: int, device: torch.device, *, tokenizer: Any = None, eos_token_ids: frozenset[int] = frozenset(),
        max_threads: int = 2,
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_threads = max_threads
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._key = (getattr(tokenizer, "name_or_path", None), type(tokenizer).__name__,
                     len(tokenizer) if tokenizer is not None else 0, vocab_size, tuple(self.eos_token_ids))
        self._matchers: dict[int, Any] = {}
        self._bitmask: torch.Tensor | None = None  # host int32 [rows, words], grown as batches grow

    # ------------------------------------------------------------- compile
    def compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads)
            return self._compiler

    def compile(self, so: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``so`` (cached by tokenizer and spec); ``ValueError`` with xgrammar's message."""
        kind, text = spec_text(so)
        key = (self._key, kind, text)
        with _cache_lock:
            hit = _cache.get(key)
            if hit is not None:
                _cache.move_to_end(key)
                return hit
        c = self.compiler()
        try:
            if kind in ("json", "json_object"):
                # compact JSON: a small model given free whitespace can spend its tokens on it
                grammar = c.compile_json_schema(text, any_whitespace=False)
            elif kind == "regex":
                grammar = c.compile_regex(text)
            else:  # choice, grammar
                grammar = c.compile_grammar(text)
        except Exception as exc:  # xgrammar raises RuntimeError (and others) naming the problem
            raise ValueError(f"structured_outputs.{kind} does not compile: {compiler_message(exc)}") from None
        with _cache_lock:
            _cache[key] = grammar
            while len(_cache) > CACHE_SIZE:
                _cache.popitem(last=False)
        return grammar

    # ----------------------------------------------------------- protocol
    def prepare(self, params: SamplingParams) -> None:
        if params.structured_outputs is None:
            return
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer, and this engine has none "
                             "(model folder without tokenizer files, or skip_tokenizer_init)")
        if params.min_tokens:
            raise ValueError(f"structured_outputs cannot be combined with min_tokens={params.min_tokens}: the grammar may "
                             "end before min_tokens, leaving no token to draw; use min_tokens=0")
        self.compile(params.structured_outputs)

    def add_request(self, key: int, params: SamplingParams, output_token_ids: Sequence[int]) -> None:
        assert params.structured_outputs is not None
        matcher = xgr.GrammarMatcher(self.compile(params.structured_outputs))
        for token in output_token_ids:  # a request this processor meets late: replay what it made
            matcher.accept_token(int(token))
        self._matchers[key] = matcher

    def apply(self, logits: torch.Tensor, rows: Sequence[int], keys: Sequence[int]) -> None:
        batch = logits.shape[0]
        words = (self.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < batch:
            self._bitmask = torch.empty(max(batch, 8), words, dtype=torch.int32,
                                        pin_memory=self.device.type == "cuda")
        mask = self._bitmask[:batch]
        for row, key in zip(rows, keys):
            matcher = self._matchers[key]
            if matcher.is_terminated():  # ended (ignore_eos): only its stop tokens stay possible
                mask[row].zero_()
                for t in self.eos_token_ids:
                    bit = 1 << (t % 32)
                    mask[row, t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32: bit 31 is the sign
            else:
                matcher.fill_next_token_bitmask(mask, row)
        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(self.vocab_size, logits.shape[1]), indices=list(rows))

    def accept(self, keys: Sequence[int], tokens: Sequence[int]) -> list[str | None]:
        out: list[str | None] = []
        for key, token in zip(keys, tokens):
            matcher = self._matchers[key]
            if matcher.is_terminated():
                out.append("stop")
            elif not matcher.accept_token(int(token)):
                out.append(f"token {token} is not allowed by the request's structured_outputs grammar here")
            else:
                out.append("stop" if matcher.is_terminated() else None)
        return out

    def remove_request(self, key: int) -> None:
        self._matchers.pop(key, None)

    @property
    def num_requests(self) -> int:
        return len(self._matchers)
