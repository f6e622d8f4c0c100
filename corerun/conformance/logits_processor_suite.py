"""``LogitsProcessorSuite``: every logits processor must pass it.

The reference is the processor itself, one request at a time in a fresh instance: a processor must
edit a request's row exactly as it would alone, whatever else is in the batch and whatever came before.

- ``rows_only``: only the rows handed to ``apply`` change, and each as its request alone would.
- ``state_per_request``: requests with the same parameters (``n > 1`` samples, or a request after a
  finished one) each start from the beginning: no state carries over from another key.
- ``replay``: ``add_request`` with tokens already made (a late join, re-admission) equals accepting them.
- ``remove``: ``remove_request`` forgets the key (later requests see the same masks as a fresh instance).

Tokens are driven through the processor's own language: each step takes the argmax of the masked row.
The requests' parameters come from :meth:`LogitsProcessorSuite.request_params` (``structured_outputs``
choices by default); a processor that needs the model's tokenizer declares ``needs_tokenizer = True``
on its class and gets the default model's.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from corerun.conformance.suite import Case, ConformanceSuite
from corerun.conformance.target import Target
from corerun.sampling_params import SamplingParams

VOCAB = 64  # without a tokenizer
STEPS = 4


@functools.lru_cache(maxsize=1)
def default_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from corerun.models.default import default_model_dir

    return AutoTokenizer.from_pretrained(str(default_model_dir(progress=False)))


class LogitsProcessorSuite(ConformanceSuite):
    """The logits-processor conformance suite.  Adopt it with::

        class TestMine(LogitsProcessorSuite):
            implementation = "mine"           # a registered name, or:
            # factory = MyProcessor           # factory(vocab_size, device, *, tokenizer, eos_token_ids, **options)
            # capabilities = LogitsProcessorCapabilities(params=frozenset({"structured_outputs"}))
    """

    kind = "logits_processor"

    def request_params(self, target: Target) -> list[SamplingParams]:
        """Two different requests the processor serves (override for a processor serving other fields)."""
        if "structured_outputs" not in target.capabilities.params:
            pytest.skip(f"{target.label} serves {sorted(target.capabilities.params)}; override request_params")
        return [
            SamplingParams(structured_outputs={"choice": ["12 7 30 4", "12 7 9", "5 33 2 2 8"]}),
            SamplingParams(structured_outputs={"choice": ["40 41", "40 50 51 52 53"]}),
        ]

    def configs(self, check: str, target: Target, full: bool) -> list[tuple[str, Any]] | str:
        return [("cpu", None)]

    # ------------------------------------------------------------------ helpers
    def _tokenizer(self, case: Case) -> Any:
        impl = case.target.factory
        if impl is None:
            from corerun.plugin.registry import resolve

            impl = resolve(case.target.registration.factory)
        return default_tokenizer() if getattr(impl, "needs_tokenizer", False) else None

    def _new(self, case: Case) -> tuple[Any, int]:
        tok = self._tokenizer(case)
        vocab = len(tok) if tok is not None else VOCAB
        eos = frozenset({tok.eos_token_id}) if tok is not None and tok.eos_token_id is not None else frozenset({0})
        return case.target.create(vocab, torch.device(case.device), tokenizer=tok, eos_token_ids=eos), vocab

    @staticmethod
    def _logits(vocab: int, rows: int, seed: int) -> torch.Tensor:
        return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))

    def _solo(self, case: Case, params: SamplingParams, steps: int) -> tuple[list[torch.Tensor], list[int]]:
        """A request alone in a fresh instance: its masked row at each step and the tokens it drove."""
        proc, vocab = self._new(case)
        proc.prepare(params)
        proc.add_request(1000, params, [])
        rows, tokens = [], []
        for step in range(steps):
            logits = self._logits(vocab, 1, seed=step)
            proc.apply(logits, [0], [1000])
            rows.append(logits[0].clone())
            token = int(logits[0].argmax())
            tokens.append(token)
            if proc.accept([1000], [token])[0] is not None:
                break
        return rows, tokens

    @staticmethod
    def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
        return bool(torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got.nan_to_num(0.0, 0.0, 0.0), want.nan_to_num(0.0, 0.0, 0.0)))

    def _masked_like(self, case: Case, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not self._same(got, want):
            differ = int((torch.isinf(got) != torch.isinf(want)).sum())
            pytest.fail(f"{what}: differs from the same request alone in a fresh {case.target.label} "
                        f"({differ} of {got.numel()} tokens masked differently)", pytrace=False)

    # ------------------------------------------------------------------ checks
    def test_rows_only(self, case: Case) -> None:
        self.start(case)
        pa, pb = self.request_params(case.target)
        ref_a, tok_a = self._solo(case, pa, STEPS)
        ref_b, tok_b = self._solo(case, pb, STEPS)
        proc, vocab = self._new(case)
        for p in (pa, pb):
            proc.prepare(p)
        proc.add_request(1, pa, [])
        proc.add_request(2, pb, [])
        for step in range(min(len(ref_a), len(ref_b))):
            raw = self._logits(vocab, 6, seed=100 + step)
            raw[4] = self._logits(vocab, 1, seed=step)[0]  # request 1 in row 4, request 2 in row 1
            raw[1] = self._logits(vocab, 1, seed=step)[0]
            logits = raw.clone()
            proc.apply(logits, [4, 1], [1, 2])
            for r in (0, 2, 3, 5):
                if not torch.equal(logits[r], raw[r]):
                    pytest.fail(f"step {step}: apply(rows=[4, 1]) changed row {r}, which no request of it holds",
                                pytrace=False)
            self._masked_like(case, f"step {step}: row 4 (request 1)", logits[4], ref_a[step])
            self._masked_like(case, f"step {step}: row 1 (request 2)", logits[1], ref_b[step])
            proc.accept([1, 2], [tok_a[step], tok_b[step]])

    def test_state_per_request(self, case: Case) -> None:
        self.start(case)
        pa, _ = self.request_params(case.target)
        ref, tokens = self._solo(case, pa, STEPS)
        proc, vocab = self._new(case)
        proc.prepare(pa)
        proc.add_request(1, pa, [])
        proc.add_request(2, pa, [])  # a second sample of the same request (n > 1)
        for step in range(min(2, len(tokens))):  # sample 1 advances; sample 2 waits
            logits = self._logits(vocab, 1, seed=step)
            proc.apply(logits, [0], [1])
            proc.accept([1], [tokens[step]])
        logits = self._logits(vocab, 1, seed=0)
        proc.apply(logits, [0], [2])
        self._masked_like(case, "a second request with the same parameters, after the first advanced", logits[0], ref[0])
        proc.remove_request(1)
        proc.add_request(3, pa, [])  # a later request, after one finished
        logits = self._logits(vocab, 1, seed=0)
        proc.apply(logits, [0], [3])
        self._masked_like(case, "a new request with the same parameters, after one finished", logits[0], ref[0])

    def test_replay(self, case: Case) -> None:
        self.start(case)
        pa, _ = self.request_params(case.target)
        ref, tokens = self._solo(case, pa, STEPS)
        if len(tokens) < 2:
            pytest.skip("the request ends after one token; nothing to replay")
        proc, vocab = self._new(case)
        proc.prepare(pa)
        proc.add_request(7, pa, tokens[:2])  # re-admitted (or met late) with two tokens made
        logits = self._logits(vocab, 1, seed=2)
        proc.apply(logits, [0], [7])
        if len(ref) > 2:
            self._masked_like(case, "add_request(key, params, two tokens made)", logits[0], ref[2])

    def test_remove(self, case: Case) -> None:
        self.start(case)
        pa, pb = self.request_params(case.target)
        ref, _ = self._solo(case, pb, 1)
        proc, vocab = self._new(case)
        for key in range(20):
            proc.prepare(pa)
            proc.add_request(key, pa, [])
            proc.remove_request(key)
        proc.remove_request(12345)  # unknown keys are ignored
        proc.prepare(pb)
        proc.add_request(99, pb, [])
        logits = self._logits(vocab, 1, seed=0)
        proc.apply(logits, [0], [99])
        self._masked_like(case, "a request after 20 added and removed", logits[0], ref[0])
        held = getattr(proc, "num_requests", None)
        if held is not None and held != 1:
            pytest.fail(f"num_requests is {held} with one request added and not removed", pytrace=False)
