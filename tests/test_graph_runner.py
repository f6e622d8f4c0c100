"""The ``cuda`` and ``eager`` graph runners, on CPU.

The CUDA-graph runner runs here with :class:`EmulatedGraphCapturer`: "capture" records the step and
"replay" re-runs it on the same static tensors with the capture-time attention plan, so the runner's
bucketing, padding, buffer handling and fallback rules are the code under test.  Every output is
checked against a float64 computation written in this file from the step's inputs (never against
the runners themselves); the KV cache is filled with a sentinel first to prove padding rows write nothing.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass

import pytest
import torch

from corerun.plugin.capabilities import AttentionCapabilities
from corerun.errors import ConfigError
from corerun.graph.buckets import bucket_for, capture_sizes
from corerun.graph.capturer import EmulatedGraphCapturer, GraphCapturer
from corerun.graph.cuda import CudaGraphRunner, probe
from corerun.graph.eager import EagerGraphRunner
from corerun.protocols.attention import AttentionBatch, AttentionSpec
from corerun.protocols.graph import GraphLimits, GraphRunner, ModelInputs
from corerun.protocols.step_layout import requests_step

MAX_BATCH = 20
MAX_MODEL_LEN = 32
BLOCK_SIZE = 4
MAX_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE
NUM_BLOCKS = MAX_BATCH * MAX_BLOCKS + 1
VOCAB = 50
HIDDEN = 16
SENTINEL = 4321.0  # finite: the torch backend masks by -inf, and 0 * NaN would poison real rows too


def limits(max_batch: int = MAX_BATCH, hidden: int = HIDDEN) -> GraphLimits:
    return GraphLimits(max_batch, MAX_MODEL_LEN, BLOCK_SIZE, hidden, torch.float32, torch.device("cpu"))


# ------------------------------------------------------------------ batches
@dataclass
class Request:
    context_len: int  # tokens already in the cache
    blocks: list[int]  # physical blocks, enough for context_len + 1 tokens
    tokens: list[int]  # context_len + 1 tokens; the last is this step's decode token

    @property
    def slot(self) -> int:
        c = self.context_len
        return self.blocks[c // BLOCK_SIZE] * BLOCK_SIZE + c % BLOCK_SIZE


def make_requests(n: int, rng: random.Random, first_block: int = 1) -> list[Request]:
    """``n`` requests with ragged context lengths and disjoint blocks (block 0 left to padding rows)."""
    free = list(range(first_block, NUM_BLOCKS))
    rng.shuffle(free)
    reqs = []
    for _ in range(n):
        c = rng.randrange(MAX_MODEL_LEN)
        nblocks = c // BLOCK_SIZE + 1
        blocks, free = free[:nblocks], free[nblocks:]
        reqs.append(Request(c, blocks, [rng.randrange(VOCAB) for _ in range(c + 1)]))
    return reqs


def decode_inputs(reqs: list[Request]) -> ModelInputs:
    """A pure-decode step for ``reqs``, laid out as the ModelRunner does (block table as wide as needed)."""
    return requests_step([r.context_len for r in reqs], [1] * len(reqs), [r.blocks for r in reqs], BLOCK_SIZE,
                         input_ids=[r.tokens[-1] for r in reqs])


def prefill_inputs(query_lens: list[int], context_lens: list[int], num_decodes: int) -> ModelInputs:
    """A step with prefill chunks (``query_len > 1``), the first ``num_decodes`` requests decoding."""
    n = len(query_lens)
    width = max(math.ceil((c + q) / BLOCK_SIZE) for c, q in zip(context_lens, query_lens))
    tables = [list(range(1 + i * width, 1 + (i + 1) * width)) for i in range(n)]
    ids = torch.randint(0, VOCAB, (sum(query_lens),)).tolist()
    inputs = requests_step(context_lens, query_lens, tables, BLOCK_SIZE, input_ids=ids)
    assert inputs.batch.num_decodes == num_decodes, "the test's decodes must come first"
    return inputs


# ------------------------------------------------- an attention-free model
class PassThroughAttention:
    """Plan = the batch itself (references its tensors only, as a graph-safe plan must)."""

    name = "passthrough"
    capabilities = AttentionCapabilities(cuda_graph_decode=True)

    def plan(self, batch: AttentionBatch) -> AttentionBatch:
        return batch


class NotGraphSafeAttention(PassThroughAttention):
    name = "not-graph-safe"
    capabilities = AttentionCapabilities(cuda_graph_decode=False)


class CopyingPlanAttention(PassThroughAttention):
    """Declares graph safety but snapshots the batch at plan time: replays would see stale values."""

    name = "copying-plan"

    def plan(self, batch: AttentionBatch) -> AttentionBatch:
        return AttentionBatch(
            batch.query_start_loc.clone(), batch.seq_lens.clone(), batch.context_lens.clone(),
            batch.block_tables.clone(), batch.slot_mapping.clone(), batch.num_reqs, batch.num_tokens,
            batch.max_query_len, batch.max_seq_len, batch.num_decodes,
        )


class ToyModel:
    """``hidden = emb[ids] + pos * p + [seq_len, context_len, sum(block_table row)] @ w`` of each token's request.

    It also counts, per KV-cache slot, how often a token with that slot ran (``writes``), skipping
    slot ``-1`` as an attention backend's K/V write does; ``calls`` records each call's token count.
    """

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(VOCAB, HIDDEN, generator=g)
        self.p = torch.randn(HIDDEN, generator=g)
        self.w = torch.randn(3, HIDDEN, generator=g)
        self.writes = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.int64)
        self.calls: list[int] = []

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, b: AttentionBatch) -> torch.Tensor:
        self.calls.append(input_ids.shape[0])
        tok = torch.arange(input_ids.shape[0])
        req = torch.searchsorted(b.query_start_loc[1:], tok.to(b.query_start_loc.dtype), right=True)
        feats = torch.stack([b.seq_lens[req], b.context_lens[req], b.block_tables[req].sum(1)], 1).float()
        self.writes.index_add_(0, b.slot_mapping.clamp(min=0), (b.slot_mapping >= 0).long())
        return self.emb[input_ids] + positions[:, None].float() * self.p + feats @ self.w

    def reference(self, inputs: ModelInputs) -> torch.Tensor:
        """The same formula in float64, written out per token from the step's inputs."""
        b = inputs.batch
        rows = []
        for i in range(b.num_reqs):
            seq, ctx = int(b.seq_lens[i]), int(b.context_lens[i])
            feats = torch.tensor([seq, ctx, int(b.block_tables[i].sum())], dtype=torch.float64)
            for t in range(int(b.query_start_loc[i]), int(b.query_start_loc[i + 1])):
                rows.append(
                    self.emb[inputs.input_ids[t]].double() + int(inputs.positions[t]) * self.p.double()
                    + feats @ self.w.double()
                )
        return torch.stack(rows)


def emulated_runner(model, attention, max_batch: int = MAX_BATCH) -> tuple[CudaGraphRunner, EmulatedGraphCapturer]:
    capturer = EmulatedGraphCapturer()
    return CudaGraphRunner(model, attention, limits(max_batch), capturer=capturer, progress=False), capturer


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    assert torch.isfinite(actual).all()
    err = ((actual.double() - expected).abs().max() / expected.abs().max()).item()
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"


# -------------------------------------------------------------------- buckets
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 20, 64, 255, 256, 257])
def test_capture_sizes_closed_form(m: int) -> None:
    sizes = capture_sizes(m)
    expected = sorted({s for s in (1, 2, 4) if s < m} | {8 * k for k in range(1, m // 8 + 1)} | {m})
    assert sizes == expected
    if m >= 8:
        assert len(sizes) == 3 + m // 8 + (m % 8 != 0)
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    for n in range(1, m + 1):  # the smallest bucket that holds n, by brute force
        assert bucket_for(n, sizes) == min(s for s in sizes if s >= n)
    assert bucket_for(m + 1, sizes) is None


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_capture_sizes_rejects_bad_maximum(bad) -> None:
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1"):
        capture_sizes(bad)


# ------------------------------------------------------- replay vs reference
def test_every_batch_size_matches_the_reference_and_padding_writes_nothing() -> None:
    model = ToyModel()
    runner, capturer = emulated_runner(model, PassThroughAttention())
    assert isinstance(runner, GraphRunner) and isinstance(capturer, GraphCapturer)
    runner.capture()
    # one warm-up per bucket, largest first, each on a fully padded bucket; capture itself runs nothing
    assert model.calls == [20, 16, 8, 4, 2, 1]
    assert capturer.warmups == len(capturer.graphs) == 6
    assert model.writes.sum() == 0
    assert runner.stats.captured_sizes == [1, 2, 4, 8, 16, 20]

    rng = random.Random(1)
    expected_writes = torch.zeros_like(model.writes)
    # descending first: each smaller batch follows a larger one in the same bucket, so stale rows would show
    sizes = list(range(MAX_BATCH, 0, -1)) + list(range(1, MAX_BATCH + 1))
    for n in sizes:
        inputs = decode_inputs(make_requests(n, rng))
        out = runner.run(inputs)
        assert out.shape == (n, HIDDEN)
        assert_close(out, model.reference(inputs))
        expected_writes[inputs.batch.slot_mapping] += 1
    assert torch.equal(model.writes, expected_writes)
    assert runner.stats.replays == len(sizes)
    assert runner.stats.eager_steps == 0 and runner.stats.fallbacks == {}
    # each step replayed the smallest bucket that holds it (graphs were captured largest first)
    replays = {size: g.replays for size, g in zip([20, 16, 8, 4, 2, 1], capturer.graphs)}
    assert replays == {b: sum(min(s for s in (1, 2, 4, 8, 16, 20) if s >= n) == b for n in sizes) for b in replays}


def test_static_rows_past_the_batch_are_padding() -> None:
    runner, _ = emulated_runner(ToyModel(), PassThroughAttention())
    runner.capture()
    c = MAX_MODEL_LEN - 1  # full-width block tables first, then a narrower, smaller step in the same bucket
    big = [Request(c, list(range(1 + 8 * i, 9 + 8 * i)), [1] * (c + 1)) for i in range(16)]
    runner.run(decode_inputs(big))
    small = [Request(2, [130 + i], [3, 3, 3]) for i in range(3)]
    runner.run(decode_inputs(small))
    s = runner.static
    assert torch.equal(s.input_ids[3:], torch.zeros(MAX_BATCH - 3, dtype=torch.int64))
    assert torch.equal(s.positions[3:], torch.zeros(MAX_BATCH - 3, dtype=torch.int64))
    assert (s.slot_mapping[3:] == -1).all() and (s.seq_lens[3:] == 1).all() and (s.context_lens[3:] == 0).all()
    assert (s.block_tables[3:] == 0).all() and (s.block_tables[:3, 1:] == 0).all()
    assert torch.equal(s.query_start_loc, torch.arange(MAX_BATCH + 1, dtype=torch.int32))


def test_output_is_a_fresh_tensor() -> None:
    model = ToyModel()
    runner, _ = emulated_runner(model, PassThroughAttention())
    runner.capture()
    rng = random.Random(3)
    first_inputs = decode_inputs(make_requests(5, rng))
    first = runner.run(first_inputs)
    runner.run(decode_inputs(make_requests(5, rng)))  # overwrites the static hidden buffer
    assert first.data_ptr() != runner.hidden.data_ptr()
    assert_close(first, model.reference(first_inputs))


def test_runner_built_in_inference_mode_also_runs_outside_it() -> None:
    model = ToyModel()
    with torch.inference_mode():
        runner, _ = emulated_runner(model, PassThroughAttention())
        runner.capture()
    rng = random.Random(10)
    for n in (3, 9):
        inputs = decode_inputs(make_requests(n, rng))
        assert_close(runner.run(inputs), model.reference(inputs))
        with torch.inference_mode():
            assert_close(runner.run(inputs), model.reference(inputs))


def test_eager_runner_matches_the_reference() -> None:
    model = ToyModel()
    runner = EagerGraphRunner(model, PassThroughAttention(), limits())
    assert isinstance(runner, GraphRunner)
    runner.capture()
    rng = random.Random(4)
    steps = [decode_inputs(make_requests(n, rng)) for n in (1, 7, 20, 33)]
    steps.append(prefill_inputs([5, 3], [0, 6], num_decodes=0))
    for inputs in steps:
        assert_close(runner.run(inputs), model.reference(inputs))
    assert runner.stats.eager_steps == len(steps) and runner.stats.replays == 0


# ------------------------------------------------------------------ fallbacks
def test_fallbacks_are_counted_by_reason_and_still_correct(caplog: pytest.LogCaptureFixture) -> None:
    model = ToyModel()
    runner, capturer = emulated_runner(model, PassThroughAttention())
    rng = random.Random(5)
    before = decode_inputs(make_requests(2, rng))
    assert_close(runner.run(before), model.reference(before))  # before capture: eager, counted
    runner.capture()
    steps = {
        "prefill": [prefill_inputs([4, 2], [0, 3], num_decodes=0), prefill_inputs([6], [9], num_decodes=0)],
        "mixed": [prefill_inputs([1, 1, 5], [4, 7, 0], num_decodes=2)],
        "batch_too_large": [decode_inputs(make_requests(MAX_BATCH + 1, rng))],
    }
    long_step = decode_inputs(make_requests(3, rng))
    long_step.batch.max_seq_len = MAX_MODEL_LEN + 1
    steps["seq_too_long"] = [long_step]
    with caplog.at_level(logging.DEBUG, logger="corerun.graph"):
        for group in steps.values():
            for inputs in group:
                assert_close(runner.run(inputs), model.reference(inputs))
    assert runner.stats.fallbacks == {"not_captured": 1, "prefill": 2, "mixed": 1, "batch_too_large": 1, "seq_too_long": 1}
    assert runner.stats.eager_steps == 6 and runner.stats.replays == 0
    assert all(g.replays == 0 for g in capturer.graphs)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("no decodes" in m for m in messages) == 1  # first prefill fallback at info ...
    assert any(r.levelno == logging.DEBUG and "eager step (prefill)" in r.getMessage() for r in caplog.records)
    assert "fallbacks: batch_too_large=1, mixed=1, not_captured=1, prefill=2, seq_too_long=1" in runner.summary()


def test_backend_without_graph_safe_decode_runs_everything_eagerly() -> None:
    model = ToyModel()
    runner, capturer = emulated_runner(model, NotGraphSafeAttention())
    runner.capture()
    assert capturer.warmups == 0 and capturer.graphs == [] and runner.stats.captured_sizes == []
    rng = random.Random(6)
    for n in (1, 8, 20):
        inputs = decode_inputs(make_requests(n, rng))
        assert_close(runner.run(inputs), model.reference(inputs))
    assert runner.stats.fallbacks == {"attention_not_graph_safe": 3} and runner.stats.replays == 0


def test_a_plan_that_copies_the_batch_is_caught() -> None:
    """The emulator replays the capture-time plan, as a GPU does: a plan that snapshots values goes stale."""
    model = ToyModel()
    runner, _ = emulated_runner(model, CopyingPlanAttention())
    runner.capture()
    inputs = decode_inputs(make_requests(4, random.Random(7)))
    out = runner.run(inputs)
    err = ((out.double() - model.reference(inputs)).abs().max() / model.reference(inputs).abs().max()).item()
    assert err > 1e-2


# -------------------------------------------------- with the torch attention
class TinyAttentionModel:
    """Embedding (+ learned positions) -> one GQA attention layer over the paged cache -> linear, with a residual."""

    def __init__(self, backend, kv_cache: torch.Tensor, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        s = backend.spec
        self.backend, self.kv_cache = backend, kv_cache
        self.hq, self.hkv, self.d = s.num_heads, s.num_kv_heads, s.head_size
        self.emb = torch.randn(VOCAB, HIDDEN, generator=g)
        self.pos = torch.randn(MAX_MODEL_LEN, HIDDEN, generator=g)
        self.wq = torch.randn(HIDDEN, self.hq * self.d, generator=g) / HIDDEN**0.5
        self.wk = torch.randn(HIDDEN, self.hkv * self.d, generator=g) / HIDDEN**0.5
        self.wv = torch.randn(HIDDEN, self.hkv * self.d, generator=g)
        self.wo = torch.randn(self.hq * self.d, HIDDEN, generator=g) / (self.hq * self.d) ** 0.5

    def embed(self, ids: torch.Tensor, positions: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        return self.emb.to(dtype)[ids] + self.pos.to(dtype)[positions]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata) -> torch.Tensor:
        x = self.embed(input_ids, positions)
        t = x.shape[0]
        q = (x @ self.wq).view(t, self.hq, self.d)
        k = (x @ self.wk).view(t, self.hkv, self.d)
        v = (x @ self.wv).view(t, self.hkv, self.d)
        a = self.backend.forward(q, k, v, self.kv_cache, metadata)
        return a.reshape(t, -1) @ self.wo + x

    def fill_history(self, reqs: list[Request]) -> None:
        """Write each request's context K/V straight into the cache (canonical view), bypassing the backend."""
        kc, vc = self.backend.kv_cache_view(self.kv_cache)
        for r in reqs:
            c = r.context_len
            x = self.embed(torch.tensor(r.tokens[:c], dtype=torch.int64), torch.arange(c))
            k, v = (x @ self.wk).view(c, self.hkv, self.d), (x @ self.wv).view(c, self.hkv, self.d)
            for p in range(c):
                kc[r.blocks[p // BLOCK_SIZE], p % BLOCK_SIZE] = k[p]
                vc[r.blocks[p // BLOCK_SIZE], p % BLOCK_SIZE] = v[p]

    def reference(self, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float64 hidden of each request's decode token, attending to its whole sequence; and its new K, V."""
        rows, new_k, new_v = [], [], []
        g = self.hq // self.hkv
        for r in reqs:
            n = r.context_len + 1
            x = self.embed(torch.tensor(r.tokens, dtype=torch.int64), torch.arange(n), torch.float64)
            q = (x[-1] @ self.wq.double()).view(self.hq, self.d)
            k = (x @ self.wk.double()).view(n, self.hkv, self.d)
            v = (x @ self.wv.double()).view(n, self.hkv, self.d)
            kh, vh = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # query head h reads KV head h // g
            p = torch.softmax(torch.einsum("hd,nhd->hn", q, kh) / self.d**0.5, dim=1)
            rows.append(torch.einsum("hn,nhd->hd", p, vh).reshape(-1) @ self.wo.double() + x[-1])
            new_k.append(k[-1])
            new_v.append(v[-1])
        return torch.stack(rows), torch.stack(new_k), torch.stack(new_v)


def test_torch_attention_every_batch_size_matches_float64_and_padding_never_writes_the_cache() -> None:
    torch_backend = pytest.importorskip("corerun.attention.torch_backend")
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8, dtype=torch.float32,
                         block_size=BLOCK_SIZE, device=torch.device("cpu"))
    backend = torch_backend.TorchAttentionBackend(spec)
    kv_cache = backend.allocate_kv_cache(NUM_BLOCKS)
    kv_cache.fill_(SENTINEL)
    model = TinyAttentionModel(backend, kv_cache)
    reqs = make_requests(MAX_BATCH, random.Random(8))  # blocks 1.., so padding rows read block 0 only
    model.fill_history(reqs)
    graphs, _ = emulated_runner(model, backend)
    eager = EagerGraphRunner(model, backend, limits())
    graphs.capture()

    order = random.Random(9)
    for n in range(MAX_BATCH, 0, -1):
        step = order.sample(reqs, n)  # a different subset and order each step
        expected, new_k, new_v = model.reference(step)
        inputs = decode_inputs(step)
        replayed = graphs.run(inputs)
        assert_close(replayed, expected)
        # decodes of the same token at the same slot write the same K/V, so eager can rerun the step
        assert_close(eager.run(inputs), expected)
        kc, vc = backend.kv_cache_view(kv_cache)
        slots = inputs.batch.slot_mapping
        assert_close(kc.reshape(-1, 2, 8)[slots], new_k)
        assert_close(vc.reshape(-1, 2, 8)[slots], new_v)
    assert graphs.stats.replays == MAX_BATCH and graphs.stats.fallbacks == {}

    # every slot that holds no real token still holds the sentinel: padding rows wrote nothing
    real = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    for r in reqs:
        for p in range(r.context_len + 1):
            real[r.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE] = True
    for cache in backend.kv_cache_view(kv_cache):
        flat = cache.reshape(NUM_BLOCKS * BLOCK_SIZE, -1)
        assert (flat[~real] == SENTINEL).all()
        assert (flat[real] != SENTINEL).all()


# -------------------------------------------------- availability and choice
def test_cuda_probe_reports_unavailable_without_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "needs a CUDA device (torch.cuda.is_available() is False)" in probe()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_registry_lists_cuda_as_unavailable_and_builds_eager() -> None:
    from corerun.errors import PluginUnavailableError
    from corerun.plugin.registry import get_registry

    reg = get_registry()
    assert "needs a CUDA device (torch.cuda.is_available() is False)" in reg.get("graph", "cuda").unavailable_reasons()
    with pytest.raises(PluginUnavailableError, match="needs a CUDA device"):
        reg.create("graph", "cuda", ToyModel(), PassThroughAttention(), limits())
    runner = reg.create("graph", "eager", ToyModel(), PassThroughAttention(), limits())
    assert isinstance(runner, EagerGraphRunner)


def test_cuda_runner_refuses_a_cpu_device_without_an_injected_capturer() -> None:
    with pytest.raises(ConfigError, match="needs a CUDA device, got device 'cpu'.*'eager'"):
        CudaGraphRunner(ToyModel(), PassThroughAttention(), limits())
    with pytest.raises(TypeError, match="capturer must provide"):
        CudaGraphRunner(ToyModel(), PassThroughAttention(), limits(), capturer=object())


def test_graph_runner_auto_goes_through_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """``graph: {runner: auto}`` is ``Registry.select``: the built-in ``cuda`` runner (priority 10) on a
    CUDA device with a graph-safe backend (a backend or its capabilities), ``eager`` otherwise, with why."""
    from corerun.plugin.capabilities import Need
    from corerun.plugin.registry import Registry

    # as on a machine with a CUDA device: the cuda runner's own probe finds a CUDA build and a device
    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reg = Registry.from_environment()  # a fresh one: the process-wide registry may have probed already
    safe, unsafe = AttentionCapabilities(cuda_graph_decode=True), AttentionCapabilities(cuda_graph_decode=False)
    assert reg.select("graph", "auto", Need(torch.device("cuda", 0), attention=safe)).name == "cuda"
    assert reg.select("graph", "auto", Need("cuda:1", attention=PassThroughAttention())).name == "cuda"
    chosen = reg.select("graph", "auto", Need("cpu", attention=safe))
    assert chosen.name == "eager" and dict((r.name, w) for r, w in chosen.passed_over)["cuda"] == "device cpu not in {cuda}"
    chosen = reg.select("graph", "auto", Need("cuda", attention=unsafe))
    assert chosen.name == "eager" and "cuda_graph_decode=False" in dict((r.name, w) for r, w in chosen.passed_over)["cuda"]


def test_an_engine_on_the_eager_runner_counts_its_steps(tmp_path):
    """The engine calls the model itself when the graph runner is a passthrough (``eager``); the runner's
    ``stats.eager_steps`` still counts every forward step: one prefill, then a decode per further token."""
    from corerun.sampling_params import SamplingParams
    from corerun.testing import make_llm
    from corerun.testing.tiny_models import make_tiny_model

    llm = make_llm(make_tiny_model(tmp_path))
    assert llm.engine.runner.graph_passthrough
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert llm.engine.runner.graph.stats.eager_steps == 4
