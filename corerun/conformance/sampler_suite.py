"""``SamplerSuite``: every sampler must pass it.

Statistical checks draw ``NUM_DRAWS`` tokens from fixed logits in one big batch and test the counts
against the float64 reference distribution (:mod:`corerun.conformance.reference.sampling`) with a
chi-square test at significance 1e-4; tokens the reference gives probability 0 must never be drawn.
Exact checks: greedy equals the argmax of the processed logits, logprobs equal ``log_softmax`` of the
raw logits, and over steps with ``seq_ids`` (requests joining, leaving, returning, histories growing)
greedy rows still follow each request's current history, and rows whose logits are not finite come
back as ``NON_FINITE`` while the rows beside them are sampled.  Only the parameters the sampler declares
(``capabilities.params``) are exercised; every other one must be refused by ``check`` with a ``corerun.UnsupportedError`` naming it.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest
import torch

from corerun.plugin.capabilities import ENGINE_PARAMS, PROCESSOR_PARAMS
from corerun.conformance.reference.sampling import boundary_margins, processed_logits
from corerun.conformance.sampler_cases import (
    MIXED_PREFERENCE, NON_FINITE_PATTERNS, NUM_DRAWS, OUTPUT, PROBE_VALUES, PROMPT, VOCAB, DistCase, applicable,
    base_logits, non_finite_logits, pair_cases, row_kinds, seeded_cases,
)
from corerun.conformance.sampler_compare import fit_problems, logprob_problems
from corerun.conformance.sampler_steps import EOS, STEPS, history_steps
from corerun.conformance.sampler_steps import VOCAB as HISTORY_VOCAB
from corerun.conformance.suite import Case, ConformanceSuite
from corerun.conformance.target import Target
from corerun.errors import UnsupportedError
from corerun.protocols.sampler import SamplingMetadata
from corerun.sampling_params import SamplingParams
from corerun.sdk.sampling import NON_FINITE

GREEDY_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _fail(case: Case, what: str, problems: list[str]) -> None:
    pytest.fail(f"{what}:\n  - " + "\n  - ".join(problems), pytrace=False)


def _sampler_fields() -> list[str]:
    return [f for f in SamplingParams.model_fields if f not in ENGINE_PARAMS | PROCESSOR_PARAMS]


class SamplerSuite(ConformanceSuite):
    """The sampler conformance suite.  Adopt it with::

        class TestMine(SamplerSuite):
            implementation = "mine"           # a registered name, or:
            # factory = MySampler             # factory(vocab_size, device, **options)
            # capabilities = SamplerCapabilities(params=frozenset({...}))
    """

    kind = "sampler"

    def declared(self, target: Target) -> frozenset[str]:
        return frozenset(target.capabilities.params)

    # ------------------------------------------------------------------ cases
    def configs(self, check: str, target: Target, full: bool) -> list[tuple[str, Any]] | str:
        declared = self.declared(target)
        if check == "distribution":
            return [(c.name, c) for c in applicable(declared) + pair_cases(declared)]
        if check == "seeded_distribution":
            if "seed" not in declared:
                return f"{target.name} does not declare seed"
            return [(f"seed+{c.name}", c) for c in seeded_cases(declared)]
        if check == "mixed_batch":
            names = [n for n in MIXED_PREFERENCE if n in {c.name for c in applicable(declared)}][:3]
            cases = [c for c in applicable(declared) if c.name in names]
            return [("+".join(c.name for c in cases), cases)]
        if check == "greedy":
            if "temperature" not in declared:
                return f"{target.name} does not declare temperature, so it has no greedy mode (temperature 0)"
            return [(name, dt) for name, dt in GREEDY_DTYPES.items()]
        if check in ("logprobs", "prompt_logprobs", "seeds"):
            need = {"logprobs": "logprobs", "prompt_logprobs": "prompt_logprobs"}.get(check, "seed")
            if need not in declared:
                return f"{target.name} does not declare {need}"
            return [("vocab64" if "logprobs" in check else f"vocab{VOCAB}", None)]
        if check == "seq_id_history":
            if "temperature" not in declared:
                return f"{target.name} does not declare temperature, so it has no greedy mode (temperature 0) to follow step by step"
            return [(f"{STEPS}-steps", None)]
        if check == "undeclared_refused":
            missing = [f for f in _sampler_fields() if f not in declared]
            if not missing:
                return f"{target.name} declares every sampling parameter; nothing to refuse"
            return [(f, f) for f in missing]
        if check == "declared_accepted":
            return [("all", sorted(f for f in declared if f in PROBE_VALUES))]
        if check == "non_finite":
            return [(name, dt) for name, dt in GREEDY_DTYPES.items()]
        if check == "masked_logits":
            if not getattr(target.capabilities, "logits_mask", False):
                return f"{target.name} does not declare logits_mask"
            return [(f"vocab{VOCAB}", None)]
        return [(f"vocab{VOCAB}", None)]  # a check a subclass added

    # ------------------------------------------------------------------ helpers
    def _sampler(self, case: Case, vocab: int) -> Any:
        return case.target.create(vocab, torch.device(case.device))

    @staticmethod
    def _tokens(case: Case, out: Any, rows: int, vocab: int) -> torch.Tensor:
        ids = getattr(out, "sampled_token_ids", None)
        if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != (rows,) or ids.dtype != torch.int64:
            got = f"{type(ids).__name__} {tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else repr(type(ids))
            _fail(case, "output", [f"sampled_token_ids must be an int64 tensor of shape ({rows},), got {got}"])
        ids = ids.cpu()
        if ((ids < 0) | (ids >= vocab)).any():
            _fail(case, "output", [f"sampled token ids outside [0, {vocab}): {ids[(ids < 0) | (ids >= vocab)][:5].tolist()}"])
        return ids

    def _draw(self, case: Case, sampler: Any, dist: DistCase, n: int, seeds: bool = False) -> torch.Tensor:
        base = base_logits()
        if seeds:
            params = [SamplingParams(**dist.params, seed=s) for s in range(n)]
        else:
            params = [dist.sampling_params()] * n
        sampler.check(params[0])
        meta = SamplingMetadata(params, [list(dist.prompt)] * n, [list(dist.output)] * n, dist.eos)
        logits = base.repeat(n, 1).to(case.device)
        return self._tokens(case, sampler.sample(logits, meta), n, VOCAB)

    # ------------------------------------------------------------------ checks
    def test_distribution(self, case: Case) -> None:
        """Draws follow exactly the distribution the parameters define (chi-square, p > 1e-4); excluded tokens never appear."""
        self.start(case)
        sampler = self._sampler(case, VOCAB)
        problems = fit_problems(case.config, self._draw(case, sampler, case.config, case.config.draws))
        if problems:
            _fail(case, "sampling distribution", problems)

    def test_mixed_batch(self, case: Case) -> None:
        """Rows with different parameters interleaved in one batch each follow their own distribution."""
        self.start(case)
        groups: list[DistCase] = case.config
        n = NUM_DRAWS
        sampler = self._sampler(case, VOCAB)
        which = [i % len(groups) for i in range(n)]
        params = [groups[g].sampling_params() for g in which]
        meta = SamplingMetadata(
            params, [list(groups[g].prompt) for g in which], [list(groups[g].output) for g in which],
            frozenset().union(*(g.eos for g in groups)),
        )
        tokens = self._tokens(case, sampler.sample(base_logits().repeat(n, 1).to(case.device), meta), n, VOCAB)
        rows = torch.tensor(which)
        problems = []
        for g, dist in enumerate(groups):
            problems += fit_problems(dist, tokens[rows == g])
        if problems:
            _fail(case, "mixed batch", problems)

    def test_seeded_distribution(self, case: Case) -> None:
        """Seeded rows (one seed each) still draw from the right distribution."""
        self.start(case)
        dist: DistCase = case.config
        n = dist.draws
        problems = fit_problems(dist, self._draw(case, self._sampler(case, VOCAB), dist, n, seeds=True))
        if problems:
            _fail(case, "seeded sampling distribution", problems)

    def test_greedy(self, case: Case) -> None:
        """``temperature=0`` rows return the argmax of the processed logits (bias, min_tokens, penalties)."""
        self.start(case)
        declared, dtype, vocab = self.declared(case.target), case.config, 256
        gen = torch.Generator().manual_seed(zlib.crc32(case.key.encode()))
        variants: list[dict[str, Any]] = [{"temperature": 0.0}]
        if {"repetition_penalty", "frequency_penalty", "presence_penalty"} <= declared:
            variants.append({"temperature": 0.0, "repetition_penalty": 1.5, "frequency_penalty": 0.7, "presence_penalty": 0.9})
        if "logit_bias" in declared:
            variants.append({"temperature": 0.0, "logit_bias": {int(t): 4.0 for t in torch.randint(vocab, (6,), generator=gen)}})
        if "min_tokens" in declared:
            variants.append({"temperature": 0.0, "min_tokens": 12, "stop_token_ids": (11, 12)})
        if {"top_k", "top_p"} <= declared:
            variants.append({"temperature": 0.0, "top_k": 3, "top_p": 0.5})
        rows, params, prompts, outputs = [], [], [], []
        for i in range(48):
            p = SamplingParams(**variants[i % len(variants)]) if i % 4 != 3 else SamplingParams()
            prompt = torch.randint(vocab, (int(torch.randint(3, 12, (1,), generator=gen)),), generator=gen).tolist()
            output = torch.randint(vocab, (int(torch.randint(0, 8, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(100):  # a row whose top two processed logits are clearly apart
                row = (torch.linspace(-6, 6, vocab, dtype=torch.float64)[torch.randperm(vocab, generator=gen)]
                       + torch.rand(vocab, generator=gen, dtype=torch.float64) * 0.02).to(dtype)
                if not p.greedy or boundary_margins(row, p, prompt, output, {0, 1})["greedy"] > 0.02:
                    break
            rows.append(row)
            params.append(p)
            prompts.append(prompt)
            outputs.append(output)
        logits = torch.stack(rows)
        meta = SamplingMetadata(params, prompts, outputs, frozenset({0, 1}))
        tokens = self._tokens(case, self._sampler(case, vocab).sample(logits.clone().to(case.device), meta), len(rows), vocab)
        problems = []
        for i, p in enumerate(params):
            if not p.greedy:
                continue
            want = int(torch.argmax(processed_logits(logits[i], p, prompts[i], outputs[i], {0, 1})))
            if int(tokens[i]) != want:
                problems.append(f"row {i} ({variants[i % len(variants)]}): drew {int(tokens[i])}, argmax of the processed logits is {want}")
        if problems:
            _fail(case, f"greedy with {dtype} logits", problems)

    def test_logprobs(self, case: Case) -> None:
        """Logprobs are ``log_softmax`` of the raw logits: sampled token in column 0 with its rank, then the top k."""
        self.start(case)
        declared, vocab = self.declared(case.target), 64
        gen = torch.Generator().manual_seed(zlib.crc32(case.key.encode()))
        ks = [0, 1, 3, 5, None, 2, 4, None, 1, 5]
        extra: dict[str, Any] = {"temperature": 0.8} if "temperature" in declared else {}
        if "top_k" in declared:
            extra["top_k"] = 10
        params = [SamplingParams(logprobs=k, **(extra if i % 2 else {})) for i, k in enumerate(ks)]
        raw = (torch.randn(len(ks), vocab, generator=gen, dtype=torch.float64) * 2.5).to(torch.float32)
        meta = SamplingMetadata(params, [[1, 2]] * len(ks), [[3]] * len(ks))
        out = self._sampler(case, vocab).sample(raw.clone().to(case.device), meta)
        tokens = self._tokens(case, out, len(ks), vocab)
        lp = out.logprobs
        if lp is None:
            _fail(case, "logprobs", ["rows asked for logprobs but SamplerOutput.logprobs is None"])
        problems = logprob_problems(raw, tokens, lp, ks)
        if problems:
            _fail(case, "logprobs", problems)

    def test_prompt_logprobs(self, case: Case) -> None:
        """``prompt_logprobs`` gives ``log_softmax`` of the raw logits at the given tokens, their ranks and the top k."""
        self.start(case)
        vocab, n, k = 64, 9, 4
        gen = torch.Generator().manual_seed(zlib.crc32(case.key.encode()))
        raw = (torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 2.5).to(torch.float32)
        token_ids = torch.randint(vocab, (n,), generator=gen)
        lp = self._sampler(case, vocab).prompt_logprobs(raw.clone().to(case.device), token_ids.to(case.device), k)
        problems = logprob_problems(raw, token_ids, lp, [k] * n)
        if problems:
            _fail(case, "prompt logprobs", problems)

    def test_seeds(self, case: Case) -> None:
        """A seeded request draws the same token alone and inside a batch at another row (same step index)."""
        self.start(case)
        vocab = VOCAB
        sampler = self._sampler(case, vocab)
        flat = base_logits() * 0.3
        seeds = list(range(100, 112))
        problems = []
        for step in (2, 5):
            history = list(OUTPUT[:step]) if step <= len(OUTPUT) else [1] * step
            alone = []
            for s in seeds:
                meta = SamplingMetadata([SamplingParams(seed=s)], [list(PROMPT)], [history])
                alone.append(int(self._tokens(case, sampler.sample(flat[None].clone().to(case.device), meta), 1, vocab)[0]))
            again = []
            for s in seeds[:3]:
                meta = SamplingMetadata([SamplingParams(seed=s)], [list(PROMPT)], [history])
                again.append(int(self._tokens(case, sampler.sample(flat[None].clone().to(case.device), meta), 1, vocab)[0]))
            if again != alone[:3]:
                problems.append(f"step {step}: the same seeds drew {again} then {alone[:3]} alone")
            # batch: unseeded filler rows first, seeded rows in reverse order, other histories around them
            params = [SamplingParams() for _ in range(5)] + [SamplingParams(seed=s) for s in reversed(seeds)]
            outputs = [[2] * (i + 1) for i in range(5)] + [history] * len(seeds)
            meta = SamplingMetadata(params, [list(PROMPT)] * len(params), outputs)
            got = self._tokens(case, sampler.sample(flat.repeat(len(params), 1).to(case.device), meta), len(params), vocab)
            in_batch = list(reversed(got[5:].tolist()))
            if in_batch != alone:
                diff = [(s, a, b) for s, a, b in zip(seeds, alone, in_batch) if a != b]
                problems.append(
                    f"step {step}: seeded tokens differ alone vs in a batch (seed, alone, batched): {diff[:4]}"
                )
            if len(set(alone)) == 1:
                problems.append(f"step {step}: 12 different seeds all drew token {alone[0]} from near-uniform logits")
        if problems:
            _fail(case, "seeds", problems)

    def test_seq_id_history(self, case: Case) -> None:
        """Steps with ``seq_ids``: greedy rows take the argmax of the processed logits of each request's
        current history while requests join, leave, come back (grown, or skipped with the same
        history), grow and finish (``finished_seq_ids``); seeded rows draw what they draw without
        ``seq_ids``.  A sampler whose per-request state goes stale fails here."""
        self.start(case)
        declared, vocab, device = self.declared(case.target), HISTORY_VOCAB, case.device
        sampler = self._sampler(case, vocab)
        problems, telling = [], 0
        for k, step in enumerate(history_steps(declared, zlib.crc32(case.key.encode()))):
            params = [row.params for row in step.rows]
            lists = ([row.prompt for row in step.rows], [row.output for row in step.rows])
            with_ids = SamplingMetadata(params, *lists, frozenset({EOS}), seq_ids=[row.seq_id for row in step.rows],
                                        finished_seq_ids=step.finished)
            tokens = self._tokens(case, sampler.sample(step.logits.clone().to(device), with_ids), len(params), vocab)
            for i, row in enumerate(step.rows):
                if not row.params.greedy:
                    continue
                raw = step.logits[i].double()
                if boundary_margins(raw, row.params, row.prompt, row.output, {EOS})["greedy"] < 0.05:
                    raise RuntimeError(f"suite input: step {k}, {row.variant} row sits near a greedy tie")
                want = int(torch.argmax(processed_logits(raw, row.params, row.prompt, row.output, {EOS})))
                stale = int(torch.argmax(processed_logits(raw, row.params, row.prompt, row.previous, {EOS})))
                telling += stale != want
                if int(tokens[i]) != want:
                    hint = " (what the history of its previous step gives: a stale history?)" if int(tokens[i]) == stale else ""
                    problems.append(
                        f"step {k}, seq_id {row.seq_id} ({row.variant}: {sorted(row.params.non_default_fields())}), prompt "
                        f"{len(row.prompt)} and output {len(row.output)} tokens: drew {int(tokens[i])}, the argmax of the "
                        f"processed logits of its current history is {want}{hint}"
                    )
            seeded = [i for i, row in enumerate(step.rows) if row.params.seed is not None]
            if seeded:
                without_ids = SamplingMetadata(params, *lists, frozenset({EOS}))
                plain = self._tokens(case, sampler.sample(step.logits.clone().to(device), without_ids), len(params), vocab)
                for i in seeded:
                    if int(tokens[i]) != int(plain[i]):
                        problems.append(
                            f"step {k}, seq_id {step.rows[i].seq_id} (seed {step.rows[i].params.seed}): drew {int(tokens[i])} "
                            f"with seq_ids and {int(plain[i])} without, from the same logits and history"
                        )
        if telling < 3 and {"repetition_penalty", "frequency_penalty", "presence_penalty"} & declared:
            raise RuntimeError(f"suite input: only {telling} rows tell a current history from a stale one")
        if problems:
            _fail(case, "per-request history over steps with seq_ids", problems)

    def test_undeclared_refused(self, case: Case) -> None:
        """``check`` refuses a parameter the sampler does not declare with an ``UnsupportedError`` naming it."""
        self.start(case)
        field_name = case.config
        if field_name not in PROBE_VALUES:
            pytest.skip(f"no probe value for the sampling field {field_name!r} in this corerun version")
        params = SamplingParams(**{field_name: PROBE_VALUES[field_name]})
        sampler = self._sampler(case, VOCAB)
        try:
            sampler.check(params)
        except UnsupportedError as exc:
            if field_name not in str(exc):
                _fail(case, "undeclared parameter", [f"check() raised UnsupportedError without naming {field_name!r}: {exc}"])
            return
        except Exception as exc:
            _fail(case, "undeclared parameter", [f"check() raised {type(exc).__name__} ({exc}), not corerun.UnsupportedError"])
        _fail(case, "undeclared parameter", [
            f"{field_name}={PROBE_VALUES[field_name]!r} is not declared ({sorted(self.declared(case.target))}) "
            "but check() accepted it; undeclared parameters must raise corerun.UnsupportedError naming them"
        ])

    def test_declared_accepted(self, case: Case) -> None:
        """``check`` accepts every parameter the sampler declares, alone and all together."""
        self.start(case)
        sampler = self._sampler(case, VOCAB)
        problems = []
        for field_name in case.config:
            try:
                sampler.check(SamplingParams(**{field_name: PROBE_VALUES[field_name]}))
            except Exception as exc:
                problems.append(f"{field_name}={PROBE_VALUES[field_name]!r} is declared but check() raised {type(exc).__name__}: {exc}")
        if len(case.config) > 1 and not problems:
            together = {f: PROBE_VALUES[f] for f in case.config}
            try:
                sampler.check(SamplingParams(**together))
            except Exception as exc:
                problems.append(f"all declared parameters together ({together}) raised {type(exc).__name__}: {exc}")
        if problems:
            _fail(case, "declared parameters", problems)

    def test_masked_logits(self, case: Case) -> None:
        """A sampler declaring ``logits_mask`` never draws a ``-inf`` token (a logits processor's mask),
        in any row kind it declares (allowed logits sit near -20: a sampler clamping -inf to 0 shows)."""
        self.start(case)
        declared = self.declared(case.target)
        kinds = [SamplingParams(temperature=1.0)]
        optional = [("temperature", {"temperature": 0.0}), ("seed", {"temperature": 1.0, "seed": 5}),
                    ("top_k", {"temperature": 1.0, "top_k": 3}), ("top_p", {"temperature": 1.0, "top_p": 0.5}),
                    ("min_p", {"temperature": 1.0, "min_p": 0.2})]
        kinds += [SamplingParams(**p) for field_name, p in optional if field_name in declared]
        rows = 64 * len(kinds)
        gen = torch.Generator().manual_seed(11)
        logits = torch.randn(rows, VOCAB, generator=gen)
        masked = torch.rand(rows, VOCAB, generator=gen) < 0.75
        masked[torch.arange(rows), torch.randint(0, VOCAB, (rows,), generator=gen)] = False  # one token stays at least
        masked[::7] = True
        masked[torch.arange(0, rows, 7), 3] = False  # every 7th row: one token allowed
        logits = torch.where(masked, torch.full_like(logits, float("-inf")), logits - 20.0)
        params = [kinds[i % len(kinds)] for i in range(rows)]
        md = SamplingMetadata(params, [[1, 2]] * rows, [[]] * rows)
        tokens = self._sampler(case, VOCAB).sample(logits.to(case.device), md).sampled_token_ids.cpu()
        drawn = masked[torch.arange(rows), tokens.long()]
        if bool(drawn.any()):
            bad = [f"row {r} ({params[r].non_default_fields() or 'defaults'}) drew token {int(tokens[r])}"
                   for r in drawn.nonzero().flatten().tolist()[:5]]
            _fail(case, f"declares logits_mask but drew -inf tokens in {int(drawn.sum())} of {rows} rows", bad)

    def test_non_finite(self, case: Case) -> None:
        """Rows whose logits are not finite (all NaN, one NaN, one ``+inf``, all ``-inf``) come back as
        ``corerun.sdk.sampling.NON_FINITE`` in every row kind the sampler declares, and only they: rows
        beside them (normal, or partly ``-inf`` as a logits processor's mask leaves them) get token
        ids in the vocabulary, greedy ones the argmax."""
        self.start(case)
        dtype, vocab = case.config, 32
        gen = torch.Generator().manual_seed(zlib.crc32(case.key.encode()))
        kinds = row_kinds(self.declared(case.target))
        labels = [(kind, params, pattern, bad) for kind, params in kinds for pattern, bad in NON_FINITE_PATTERNS] * 2
        labels = [labels[i] for i in torch.randperm(len(labels), generator=gen).tolist()]  # bad rows between good ones
        logits = torch.stack([non_finite_logits(pattern, vocab, gen) for _, _, pattern, _ in labels]).to(dtype)
        params = [SamplingParams(**p) for _, p, _, _ in labels]
        meta = SamplingMetadata(params, [[1, 2]] * len(labels), [[3]] * len(labels))
        try:
            out = self._sampler(case, vocab).sample(logits.clone().to(case.device), meta)
        except Exception as exc:
            _fail(case, f"non-finite logits ({case.id} logits)", [
                f"sample() raised {type(exc).__name__} ({exc}) on a batch with non-finite rows; it must return "
                f"NON_FINITE ({NON_FINITE}) for those rows and sample the others"])
        ids = getattr(out, "sampled_token_ids", None)
        if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != (len(labels),) or ids.dtype != torch.int64:
            self._tokens(case, out, len(labels), vocab)  # fails naming what came back
        got = ids.cpu().tolist()
        problems = []
        for i, ((kind, _, pattern, bad), token) in enumerate(zip(labels, got)):
            where = f"row {i} ({kind}, {pattern} logits)"
            if bad and token != NON_FINITE:
                problems.append(f"{where}: drew {token}; a row whose logits are not finite must come back as "
                                f"NON_FINITE ({NON_FINITE}, corerun.sdk.sampling.mark_non_finite)")
            elif not bad and not 0 <= token < vocab:
                problems.append(f"{where}: drew {token}; its logits are usable, so a token id in [0, {vocab}) is right")
            elif not bad and kind == "greedy" and logits[i, token] != logits[i].max():
                problems.append(f"{where}: drew {token}, the argmax is {int(logits[i].argmax())}")
        if problems:
            _fail(case, f"non-finite logits ({case.id} logits): {len(problems)} of {len(labels)} rows wrong", problems)
