"""``GraphRunnerSuite``: every graph runner must pass it.

The runner wraps a tiny model (:mod:`corerun.conformance.graph_model`) whose attention goes through
a registered backend: ``torch`` unless ``attention_backend`` names another
(``corerun conformance graph:cuda --attention triton``), which is how an attention backend that declares
``cuda_graph_decode`` proves it replays correctly inside a captured graph.  For every pure-decode batch size from 1 to ``max_batch_size`` the
runner's output must equal the eager model's; rows it pads with never change real rows nor write the
KV cache; prefill / mixed batches and batches above the maximum must still come out right (eagerly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch

from corerun.conformance.graph_model import TinyModel
from corerun.conformance.suite import Case, ConformanceSuite
from corerun.conformance.target import Target
from corerun.conformance.tolerances import SHORT_DTYPE, within
from corerun.protocols.attention import DTYPE_NAMES, AttentionSpec
from corerun.protocols.graph import GraphLimits, ModelInputs
from corerun.protocols.step_layout import requests_step

VOCAB, HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 97, 64, 4, 2, 16
BLOCKS_PER_SEQ = 6
CAPTURE_MAX_MODEL_LEN = 2048  # GraphLimits.max_model_len of every case (past triton's split-KV threshold)


@dataclass(frozen=True)
class GraphConfig:
    dtype: str
    block_size: int
    max_batch_size: int
    attention: str | None = None  # None: the suite's ``attention_backend``

    @property
    def id(self) -> str:
        prefix = "" if self.attention in (None, "torch") else f"{self.attention}-"
        return f"{prefix}{SHORT_DTYPE[self.dtype]}-bs{self.block_size}-max{self.max_batch_size}"


@dataclass
class World:
    """Model, attention backend and runner of one case; request ``r`` owns a fixed set of blocks and context."""

    spec: AttentionSpec
    attention: Any
    model: TinyModel
    runner: Any
    tables: list[list[int]]
    contexts: list[int]

    def inputs(self, requests: list[tuple[int, int]]) -> ModelInputs:
        """A step for ``[(request, query_len), ...]`` (decodes first) over the requests' cached contexts."""
        bs = self.spec.block_size
        ctx = [self.contexts[r] for r, _ in requests]
        ids = [(r * 31 + (c + j) * 7) % VOCAB for (r, q), c in zip(requests, ctx) for j in range(q)]
        width = max(-(-(c + q) // bs) for (_, q), c in zip(requests, ctx))
        tables = [self.tables[r][:width] for r, _ in requests]
        return requests_step(ctx, [q for _, q in requests], tables, bs, self.spec.device, input_ids=ids)


class GraphRunnerSuite(ConformanceSuite):
    """The graph-runner conformance suite.  Adopt it with::

        class TestMine(GraphRunnerSuite):
            implementation = "mine"   # or factory = staticmethod(make); factory(model, attention, limits, **options)
    """

    kind = "graph"
    attention_backend: ClassVar[str] = "torch"  # the registered backend the tiny model attends with
    attention_options: ClassVar[dict[str, Any]] = {}  # its options (e.g. {"num_splits": 4} for triton)

    def configs(self, check: str, target: Target, full: bool) -> list[tuple[str, Any]] | str:
        from corerun.plugin.capabilities import AttentionCapabilities
        from corerun.plugin.registry import get_registry

        name = self.attention_backend
        caps = get_registry().get("attention", name).capabilities or AttentionCapabilities()
        dtypes = [d for d in (("float32", "bfloat16", "float16") if full else ("float32", "bfloat16")) if d in caps.dtypes]
        if not dtypes:
            dtypes = sorted(caps.dtypes)[:1]
        # block sizes the backend accepts: 16 and 32 when allowed, else the smallest from 16 up (the
        # suite's sequences are a few blocks long), else the largest it has
        if caps.block_sizes:
            preferred = sorted(b for b in caps.block_sizes if b >= 16) or [max(caps.block_sizes)]
            sizes = preferred[: 2 if full else 1]
        else:
            sizes = [16, 32] if full else [16]
        return [(c.id, c) for c in (GraphConfig(d, b, 8, name) for d in dtypes for b in sizes)]

    def start(self, case: Case | None) -> None:
        """The base checks, then: skip (with every reason) when the attention backend cannot serve the case."""
        super().start(case)
        from corerun.plugin.registry import get_registry

        cfg: GraphConfig = case.config
        name = self._attention_name(cfg)
        reg = get_registry().get("attention", name)
        spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, DTYPE_NAMES[cfg.dtype], cfg.block_size, torch.device(case.device))
        reasons = reg.unavailable_reasons() + (reg.capabilities.check(spec) if reg.capabilities else [])
        if reasons:
            pytest.skip(f"attention backend '{name}' cannot serve this case here: " + "; ".join(reasons))

    def _attention_name(self, cfg: GraphConfig) -> str:
        return cfg.attention or self.attention_backend

    # ------------------------------------------------------------------ helpers
    def _world(self, case: Case) -> World:
        from corerun.plugin.registry import get_registry

        cfg: GraphConfig = case.config
        dev = torch.device(case.device)
        spec = AttentionSpec(NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, DTYPE_NAMES[cfg.dtype], cfg.block_size, dev)
        attention = get_registry().get("attention", self._attention_name(cfg)).create(spec, options=self.attention_options)
        num_requests = cfg.max_batch_size + 3
        num_blocks = num_requests * BLOCKS_PER_SEQ + 2
        model = TinyModel(attention, spec, VOCAB, HIDDEN, num_blocks)
        gen = torch.Generator().manual_seed(11)
        order = torch.randperm(num_blocks, generator=gen).tolist()
        tables = [order[r * BLOCKS_PER_SEQ:(r + 1) * BLOCKS_PER_SEQ] for r in range(num_requests)]
        max_len = BLOCKS_PER_SEQ * cfg.block_size
        contexts = [(r * 13 + 5) % (max_len - 8) for r in range(num_requests)]
        k, v = attention.kv_cache_view(model.kv_cache)
        k.copy_((torch.randn(k.shape, generator=gen, dtype=torch.float64)).to(spec.dtype).to(dev))
        v.copy_((torch.randn(v.shape, generator=gen, dtype=torch.float64)).to(spec.dtype).to(dev))
        # captures are bounded by a long max_model_len (as in serving), not by the short contexts used
        # here: a backend that picks its decode path from that bound (triton's split-KV) takes the same
        # path inside the graph as on a real deployment's GPU
        limits = GraphLimits(cfg.max_batch_size, max(max_len, CAPTURE_MAX_MODEL_LEN), cfg.block_size, HIDDEN, spec.dtype, dev)
        runner = case.target.create(model, attention, limits)
        runner.capture()
        return World(spec, attention, model, runner, tables, contexts)

    def _compare(self, w: World, requests: list[tuple[int, int]], label: str, per_row: bool = False) -> list[str]:
        """Run the step through the runner and eagerly (restoring the cache between), compare output and cache."""
        inputs = w.inputs(requests)
        cache = w.model.kv_cache
        snapshot = cache.clone()
        out = w.runner.run(inputs)
        after_runner = cache.clone()
        cache.copy_(snapshot)
        if per_row:
            parts = []
            for r, q in requests:  # requests own disjoint blocks: their writes accumulate independently
                one = w.inputs([(r, q)])
                parts.append(w.model(one.input_ids, one.positions, w.attention.plan(one.batch)))
            ref = torch.cat(parts)
        else:
            ref = w.model(inputs.input_ids, inputs.positions, w.attention.plan(inputs.batch))
        after_eager = cache.clone()
        cache.copy_(snapshot)
        problems: list[str] = []
        want = (inputs.batch.num_tokens, HIDDEN)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            return [f"{label}: run() returned {shape}, expected hidden states of shape {want}"]
        ok, how = within(str(w.spec.dtype).removeprefix("torch."), out, ref)
        if not ok:
            rows = (out.double() - ref.double()).abs().amax(-1)
            problems.append(f"{label}: hidden states differ from the eager model ({how}); worst row {int(rows.argmax())}")
        bs = w.spec.block_size
        for name, got, exp, snap in zip(
            "KV", w.attention.kv_cache_view(after_runner), w.attention.kv_cache_view(after_eager), w.attention.kv_cache_view(snapshot)
        ):
            mask = torch.zeros(got.shape[:2], dtype=torch.bool)
            slots = inputs.batch.slot_mapping.cpu()
            slots = slots[slots >= 0]
            mask[slots // bs, slots % bs] = True
            g, e, s = got.cpu(), exp.cpu(), snap.cpu()
            stray = ((g != s).flatten(2).any(-1) & ~mask).nonzero().tolist()
            if stray:
                b, o = stray[0]
                problems.append(f"{label}: {len(stray)} {name}-cache slots no real token names were written (first: block {b} offset {o})")
            ok, how = within(str(w.spec.dtype).removeprefix("torch."), g[mask], e[mask])
            if not ok:
                problems.append(f"{label}: the {name} written for this step differs from the eager model's ({how})")
        return problems

    def _fail(self, case: Case, what: str, problems: list[str]) -> None:
        pytest.fail(f"{what}:\n  - " + "\n  - ".join(problems), pytrace=False)

    # ------------------------------------------------------------------ checks
    def test_decode_matches_eager(self, case: Case) -> None:
        """Every pure-decode batch size 1..max_batch_size equals the eager model (output and KV written)."""
        self.start(case)
        w = self._world(case)
        replays_before = w.runner.stats.replays
        problems: list[str] = []
        for b in range(1, case.config.max_batch_size + 1):
            problems += self._compare(w, [(r, 1) for r in range(b)], f"decode batch of {b}")
        # a runner that captures must replay pure decodes, and must not when the backend keeps its
        # decodes out of graphs (it does not declare cuda_graph_decode)
        captures = bool(getattr(case.target.capabilities, "captures", False))
        graph_safe = bool(getattr(w.attention.capabilities, "cuda_graph_decode", False))
        if captures and not problems:
            stats = w.runner.stats
            if not graph_safe:
                if stats.replays > replays_before or stats.captured_sizes:
                    problems.append(
                        f"attention backend '{self._attention_name(case.config)}' does not declare cuda_graph_decode, "
                        f"yet the runner captured {stats.captured_sizes} and replayed {stats.replays - replays_before} steps"
                    )
            elif not stats.captured_sizes or max(stats.captured_sizes) > case.config.max_batch_size:
                problems.append(f"declares captures but stats.captured_sizes is {stats.captured_sizes} after capture()")
            elif stats.replays <= replays_before:
                problems.append("declares captures but stats.replays did not grow over pure-decode batches")
        # a runner that records (replay) must replay pure decodes when the backend declares them recordable: a
        # backend whose C calls the tape cannot see is refused at capture, and its declaration is then wrong
        records = bool(getattr(case.target.capabilities, "records", False))
        if records and not problems and getattr(w.attention.capabilities, "replay_decode", False):
            stats = w.runner.stats
            if not stats.captured_sizes or stats.replays <= replays_before:
                why = "; ".join(f"bucket {b}: {r}" for b, r in sorted(getattr(w.runner, "refusals", {}).items())[:1])
                problems.append(
                    f"attention backend '{self._attention_name(case.config)}' declares replay_decode, yet the runner "
                    f"recorded {stats.captured_sizes} and replayed {stats.replays - replays_before} steps" + (f" ({why})" if why else "")
                )
        if problems:
            self._fail(case, "decode batches", problems)

    def test_padding_isolation(self, case: Case) -> None:
        """Each real row of a (possibly padded) decode batch equals that request run alone."""
        self.start(case)
        w = self._world(case)
        m = case.config.max_batch_size
        problems: list[str] = []
        for b in sorted({3, 5, m - 1, m} - {0}):
            problems += self._compare(w, [(r, 1) for r in reversed(range(b))], f"decode batch of {b} vs one request at a time", per_row=True)
        if problems:
            self._fail(case, "padding rows", problems)

    def test_prefill_and_mixed(self, case: Case) -> None:
        """Prefill and mixed prefill + decode steps (never captured) still equal the eager model."""
        self.start(case)
        w = self._world(case)
        problems = self._compare(w, [(0, 1), (1, 1), (2, 5)], "mixed batch")
        problems += self._compare(w, [(3, 4), (4, 2)], "prefill batch")
        if problems:
            self._fail(case, "prefill / mixed steps", problems)

    def test_oversize_batch(self, case: Case) -> None:
        """A decode batch larger than max_batch_size runs (eagerly) and equals the eager model."""
        self.start(case)
        w = self._world(case)
        problems = self._compare(w, [(r, 1) for r in range(case.config.max_batch_size + 2)], "decode batch above max_batch_size")
        if problems:
            self._fail(case, "oversize batch", problems)
