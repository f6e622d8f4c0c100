"""``AttentionBackendSuite``: every attention backend must pass it.

Each forward check builds one step (:mod:`corerun.conformance.attention_scenario`): random Q/K/V in
the case's dtype, a paged cache full of finite garbage with shuffled block tables, a poisoned (NaN)
``out``; it then compares the real rows with a float64 reference that reads K/V through the block
table (:mod:`corerun.conformance.reference.attention`), and checks the cache slot by slot.
"""

from __future__ import annotations

import zlib
from dataclasses import replace
from typing import Any

import pytest
import torch

from corerun.conformance.attention_matrix import AttentionConfig, attention_configs, unsupported_configs
from corerun.conformance.attention_scenario import Scenario, build_scenario, cache_failures, output_failures
from corerun.conformance.reference.attention import paged_attention_reference
from corerun.conformance.reference.kv_quant import attention_bound, element_bound, fake_quant
from corerun.conformance.tolerances import TOLERANCES, within
from corerun.conformance.suite import Case, ConformanceSuite
from corerun.conformance.target import Target
from corerun.errors import UnsupportedError
from corerun.protocols.attention import KV_CACHE_DTYPES, dtype_name
from corerun.protocols.step_layout import requests_step

# fp8's per-tensor (k_scale, v_scale) in the KV-dtype check: not 1, so a backend that drops one is seen
KV_SCALES = (0.37, 1.7)


def _fail(case: Case, what: str, problems: list[str]) -> None:
    pytest.fail(f"{what}:\n  - " + "\n  - ".join(problems), pytrace=False)


class AttentionBackendSuite(ConformanceSuite):
    """The attention conformance suite.  Adopt it with::

        class TestMine(AttentionBackendSuite):
            implementation = "mine"          # a registered name, or:
            # factory = staticmethod(make)   # factory(spec, **options) -> backend
            # capabilities = AttentionCapabilities(...)
    """

    kind = "attention"

    # ------------------------------------------------------------------ cases
    def configs(self, check: str, target: Target, full: bool) -> list[tuple[str, Any]] | str:
        caps = target.capabilities
        if check == "unsupported":
            cases: list[tuple[str, Any]] = [(cid, (cfg, what, None)) for cid, cfg, what in unsupported_configs(caps)]
            base = attention_configs(caps, full=False)
            if "cpu" not in caps.devices and base:
                cases.append(("device-cpu", (base[0], "device cpu", "cpu")))
            if not cases:
                return (
                    f"{target.name} declares every dtype, any head size, any block size and GQA: "
                    "there is no undeclared combination to refuse"
                )
            return cases
        configs = attention_configs(caps, full)
        if not configs:
            return f"{target.name} declares no dtype / head size / block size it supports"
        if check == "kv_cache_dtype":  # every format, declared (checked) or not (refused), on the sharpest dtype
            base = next((c for c in configs if c.dtype in ("float32", "float64")), configs[0])
            return [(f"{kv}-{base.id}", (base, kv)) for kv in KV_CACHE_DTYPES]
        return [(c.id, c) for c in configs]

    # ------------------------------------------------------------------ helpers
    def _backend(self, case: Case, **spec_changes: Any) -> tuple[Any, Any]:
        """``(spec, backend)`` for the case's configuration (with ``spec_changes``); refusing a declared one fails the check."""
        cfg: AttentionConfig = case.config
        spec = replace(cfg.spec(case.device), **spec_changes)
        try:
            return spec, case.target.create(spec)
        except UnsupportedError as exc:
            pytest.fail(f"{case.target.label} declares {cfg.id} but refused it: {exc}", pytrace=False)

    @staticmethod
    def _seed(case: Case, salt: str = "") -> int:
        return zlib.crc32(f"{case.key}{salt}".encode())

    def _step(
        self, case: Case, requests: list[tuple[int, int]], what: str, spec_changes: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Scenario:
        """Run one step through ``plan`` + ``forward`` into a NaN-poisoned ``out`` and check everything
        (``spec_changes``: sliding windows, soft cap; ``layer=`` in ``kwargs``: the layer to run)."""
        spec, backend = self._backend(case, **(spec_changes or {}))
        sc = build_scenario(backend, spec, requests, seed=self._seed(case, str(kwargs)), **kwargs)
        out = torch.full((sc.batch.num_tokens, spec.num_heads, spec.head_size), float("nan"), dtype=spec.dtype, device=spec.device)
        metadata = backend.plan(sc.batch)
        layer = {"layer": kwargs.get("layer", 0)} if spec.per_layer else {}
        result = backend.forward(sc.query, sc.key, sc.value, sc.cache, metadata, out=out, **layer)
        problems = [f"out: {p}" for p in output_failures(sc, out)]
        if result is not None and result is not out:
            problems += [f"returned tensor: {p}" for p in output_failures(sc, result)]
        problems += cache_failures(sc, backend)
        if problems:
            _fail(case, what, problems)
        return sc

    # ------------------------------------------------------------------ checks
    def test_cache_layout(self, case: Case) -> None:
        """``kv_cache_view`` gives ``[num_blocks, block_size, num_kv_heads, head_size]`` views whose writes land
        in the cache, and ``kv_cache_bytes_per_block`` matches what ``allocate_kv_cache`` allocates."""
        self.start(case)
        spec, backend = self._backend(case)
        problems = []
        per_block = backend.kv_cache_bytes_per_block()
        minimum = 2 * spec.block_size * spec.num_kv_heads * spec.head_size * torch.tensor([], dtype=spec.dtype).element_size()
        if per_block < minimum:
            problems.append(f"kv_cache_bytes_per_block() is {per_block}, less than K and V need ({minimum})")
        sizes: dict[int, int] = {}
        for n in (3, 7):
            cache = backend.allocate_kv_cache(n)
            sizes[n] = nbytes = cache.numel() * cache.element_size()
            if nbytes < n * per_block:
                problems.append(f"allocate_kv_cache({n}) holds {nbytes} bytes, less than {n} x kv_cache_bytes_per_block() = {n * per_block}")
            k, v = backend.kv_cache_view(cache)
            want = (n, spec.block_size, spec.num_kv_heads, spec.head_size)
            for name, view in (("K", k), ("V", v)):
                if tuple(view.shape) != want or view.dtype != spec.dtype or view.device.type != spec.device.type:
                    problems.append(
                        f"kv_cache_view {name} is {tuple(view.shape)} {view.dtype} on {view.device}, "
                        f"expected {want} {spec.dtype} on {spec.device.type}"
                    )
            if problems:
                break
            fill_k = torch.randn(want, dtype=torch.float64).to(spec.dtype).to(spec.device)
            fill_v = torch.randn(want, dtype=torch.float64).to(spec.dtype).to(spec.device)
            k.copy_(fill_k)
            v.copy_(fill_v)
            k2, v2 = backend.kv_cache_view(cache)
            if not (torch.equal(k2, fill_k) and torch.equal(v2, fill_v)):
                problems.append("values written through kv_cache_view are not read back through a fresh view (K and V overlap?)")
        if not problems and sizes[7] - sizes[3] != 4 * per_block:
            problems.append(
                f"each block costs {(sizes[7] - sizes[3]) / 4:g} bytes (allocate_kv_cache(7) - allocate_kv_cache(3), over 4), "
                f"but kv_cache_bytes_per_block() says {per_block}: memory sizing would be wrong"
            )
        if problems:
            _fail(case, "cache layout", problems)

    def test_kv_write(self, case: Case) -> None:
        """``write_kv`` into a NaN-poisoned cache: exactly the named slots change; ``-1`` writes nothing."""
        self.start(case)
        spec, backend = self._backend(case)
        bs, num_blocks = spec.block_size, 5
        gen = torch.Generator().manual_seed(self._seed(case))
        cache = backend.allocate_kv_cache(num_blocks)
        kview, vview = backend.kv_cache_view(cache)
        kview.fill_(float("nan"))
        vview.fill_(float("nan"))
        chosen = torch.randperm(num_blocks * bs, generator=gen)[: 2 * bs + 3].tolist()
        slots = chosen[:bs] + [-1, -1] + chosen[bs:] + [-1]
        n = len(slots)
        shape = (n, spec.num_kv_heads, spec.head_size)
        key = torch.randn(shape, generator=gen, dtype=torch.float64).to(spec.dtype).to(spec.device)
        value = torch.randn(shape, generator=gen, dtype=torch.float64).to(spec.dtype).to(spec.device)
        backend.write_kv(key, value, cache, torch.tensor(slots, dtype=torch.int64, device=spec.device))
        kview, vview = backend.kv_cache_view(cache)
        problems = []
        real = [(i, s) for i, s in enumerate(slots) if s >= 0]
        idx = torch.tensor([s for _, s in real])
        rows = [i for i, _ in real]
        for name, view, new in (("K", kview, key), ("V", vview, value)):
            got = view.detach().cpu()
            written = got[idx // bs, idx % bs]
            wrong = (written != new[rows].cpu()).flatten(1).any(-1)
            if wrong.any():
                first = int(torch.nonzero(wrong)[0])
                s = real[first][1]
                problems.append(
                    f"{name}: {int(wrong.sum())} of {len(real)} named slots do not hold the written values "
                    f"(first: token {real[first][0]} -> slot {s} = block {s // bs} offset {s % bs})"
                )
            untouched = torch.ones(num_blocks, bs, dtype=torch.bool)
            untouched[idx // bs, idx % bs] = False
            stray = (~torch.isnan(got[untouched])).flatten(1).any(-1)
            if stray.any():
                flat = torch.nonzero(untouched.flatten()).flatten()[torch.nonzero(stray).flatten()]
                first = int(flat[0])
                problems.append(
                    f"{name}: {int(stray.sum())} slots no token names were written (first: slot {first} = block "
                    f"{first // bs} offset {first % bs}); slot_mapping -1 must write nothing"
                )
        if problems:
            _fail(case, "write_kv", problems)

    def test_prefill(self, case: Case) -> None:
        """Prefill with nothing cached: causal attention within each prompt, ragged prompt lengths."""
        self.start(case)
        bs = case.config.block_size
        self._step(case, [(0, bs + 3), (0, 2), (0, 2 * bs)], "prefill without a cached prefix")

    def test_prefill_cached_prefix(self, case: Case) -> None:
        """Prefill chunks after a cached prefix (block-aligned and not): queries attend to cache + chunk."""
        self.start(case)
        bs = case.config.block_size
        self._step(case, [(bs, 5), (3, bs + 2), (2 * bs + 1, 3)], "prefill with a cached prefix")

    def test_decode(self, case: Case) -> None:
        """Pure decode over ragged context lengths (including an empty context)."""
        self.start(case)
        bs = case.config.block_size
        self._step(case, [(5, 1), (0, 1), (2 * bs + 6, 1), (bs - 2, 1), (3 * bs + 1, 1), (11, 1)], "decode")

    def test_mixed(self, case: Case) -> None:
        """Decodes first, then prefill chunks with and without a cached prefix, in one batch."""
        self.start(case)
        bs = case.config.block_size
        self._step(case, [(bs + 2, 1), (7, 1), (2 * bs - 1, 1), (0, bs + 1), (bs, 5), (5, 3)], "mixed prefill + decode batch")

    def test_draft_verification(self, case: Case) -> None:
        """Speculative decoding's verification rows: decodes, then rows of 1 + K query tokens (K = 1..4)
        over a cached context, some crossing a block boundary inside the drafts."""
        self.start(case)
        bs = case.config.block_size
        requests = [(bs + 2, 1), (6, 1), (2 * bs - 1, 4), (bs - 2, 5), (3 * bs + 1, 3), (bs, 2), (1, 4)]
        self._step(case, requests, "verification rows (1 + K queries over a cached context)")

    def test_block_boundaries(self, case: Case) -> None:
        """Sequences ending exactly on a block boundary, one before and one past it."""
        self.start(case)
        bs = case.config.block_size
        requests = [(bs - 1, 1), (bs, 1), (2 * bs - 1, 1), (2 * bs, 1), (0, bs), (0, bs + 1), (bs, bs), (bs - 1, 2)]
        self._step(case, requests, "block boundaries")

    def test_shuffled_block_tables(self, case: Case) -> None:
        """The same kind of batch over descending and randomly permuted physical blocks."""
        self.start(case)
        bs = case.config.block_size
        requests = [(2 * bs + 3, 1), (bs + 1, 1), (bs - 1, bs + 2)]
        self._step(case, requests, "descending block table", layout="reversed")
        self._step(case, requests, "randomly permuted block table", layout="random", spare_blocks=6)

    def test_padding_slots(self, case: Case) -> None:
        """CUDA-graph padding rows (slot -1, length 1) write nothing and leave real rows intact;
        ``max_seq_len`` may be a loose upper bound."""
        self.start(case)
        bs = case.config.block_size
        requests = [(bs + 4, 1), (3, 1), (2 * bs, 1)]
        self._step(case, requests, "decode batch with padding rows", num_padding=3, extra_seq_len=2 * bs)

    def _refuses(self, case: Case, what: str, **spec_changes: Any) -> bool:
        """When the backend does not declare ``what``, check it refuses a spec asking for it; ``True`` then."""
        cfg: AttentionConfig = case.config
        spec = replace(cfg.spec(case.device), **spec_changes)
        if not spec.per_layer and spec.logits_soft_cap is None:
            return False
        declared = case.target.capabilities
        if all(getattr(declared, flag) for flag, asked in (("sliding_window", spec.per_layer),
                                                            ("logits_soft_cap", spec.logits_soft_cap is not None)) if asked):
            return False
        try:
            case.target.create(spec)
        except UnsupportedError:
            return True
        pytest.fail(f"{case.target.label} does not declare {what} but constructed a backend for a spec asking for it "
                    f"({spec_changes}); it must raise corerun.UnsupportedError", pytrace=False)

    def test_sliding_window(self, case: Case) -> None:
        """Per-layer sliding windows (``capabilities.sliding_window``): layer 1 of the spec attends to the last
        ``block_size + 3`` keys, across block boundaries, in decodes, prefills past the window and chunks after
        a cached prefix longer than it; layer 0 of the same spec stays full.  A backend that does not declare
        sliding windows must refuse the spec."""
        self.start(case)
        bs = case.config.block_size
        window = bs + 3
        changes = {"sliding_windows": (None, window)}
        if self._refuses(case, "sliding windows", **changes):
            return
        requests = [(2 * bs + 6, 1), (3, 1), (window, 1), (window - 1, 1), (bs + 1, bs + 2), (0, 2 * bs + 3), (window + 2, 4)]
        self._step(case, requests, f"sliding window of {window} (layer 1)", changes, layer=1)
        self._step(case, [(2 * bs + 6, 1), (0, 2 * bs + 3)], "full attention (layer 0) beside a sliding layer", changes, layer=0)

    def test_soft_cap(self, case: Case) -> None:
        """Attention logit soft-capping (``capabilities.logits_soft_cap``): scores ``cap * tanh(score / cap)``
        with a cap (1.5) most scores reach; with sliding windows too when the backend declares them.  A backend
        that does not declare soft-capping must refuse the spec."""
        self.start(case)
        bs = case.config.block_size
        changes: dict[str, Any] = {"logits_soft_cap": 1.5}
        if self._refuses(case, "logit soft-capping", **changes):
            return
        requests = [(2 * bs + 6, 1), (bs - 1, 1), (0, bs + 3), (bs, 5)]
        self._step(case, requests, "soft cap 1.5", changes)
        if case.target.capabilities.sliding_window:
            changes["sliding_windows"] = (bs + 1,)
            self._step(case, requests, f"soft cap 1.5 with a sliding window of {bs + 1}", changes, layer=0)

    def test_out_fully_written(self, case: Case) -> None:
        """``forward`` returns ``out`` itself when given (every real row written) and works without it."""
        self.start(case)
        spec, backend = self._backend(case)
        bs = spec.block_size
        sc = build_scenario(backend, spec, [(bs + 1, 1), (2, bs)], seed=self._seed(case))
        out = torch.full((sc.batch.num_tokens, spec.num_heads, spec.head_size), float("nan"), dtype=spec.dtype, device=spec.device)
        result = backend.forward(sc.query, sc.key, sc.value, sc.cache, backend.plan(sc.batch), out=out)
        problems = []
        if result is None or result.data_ptr() != out.data_ptr():
            problems.append("forward(..., out=out) did not return out itself")
        problems += [f"out: {p}" for p in output_failures(sc, out)]
        sc2 = build_scenario(backend, spec, [(bs + 1, 1), (2, bs)], seed=self._seed(case, "no-out"))
        fresh = backend.forward(sc2.query, sc2.key, sc2.value, sc2.cache, backend.plan(sc2.batch))
        problems += [f"without out: {p}" for p in output_failures(sc2, fresh)]
        if problems:
            _fail(case, "output buffer", problems)

    def test_kv_cache_dtype(self, case: Case) -> None:
        """A quantized KV cache (``capabilities.kv_cache_dtypes``; fp8 with scales ``KV_SCALES``): a context written
        by ``write_kv``, then decodes and prefill chunks through ``forward``.  The output must match float64
        attention over K/V rounded by the reference (:mod:`corerun.conformance.reference.kv_quant`) within the
        dtype's tolerance, and the unquantized float64 result within the bound the format implies.  A backend
        that does not declare the format must refuse the spec."""
        self.start(case)
        cfg, kv = case.config
        spec = replace(cfg.spec(case.device), kv_cache_dtype=kv, kv_scales=KV_SCALES)
        if kv not in case.target.capabilities.kv_cache_dtypes:
            try:
                case.target.create(spec)
            except UnsupportedError:
                return
            pytest.fail(f"{case.target.label} does not declare kv_cache_dtype {kv} but constructed a backend for it; "
                        "it must raise corerun.UnsupportedError", pytrace=False)
        try:
            backend = case.target.create(spec)
        except UnsupportedError as exc:
            pytest.fail(f"{case.target.label} declares kv_cache_dtype {kv} but refused {cfg.id} with it: {exc}", pytrace=False)
        bs, dev = spec.block_size, spec.device
        requests = [(2 * bs + 5, 1), (bs - 1, 1), (0, bs + 3), (bs + 2, 4)]
        gen = torch.Generator().manual_seed(self._seed(case))
        seqs = [c + q for c, q in requests]
        need = [-(-n // bs) for n in seqs]
        order = torch.randperm(sum(need) + 2, generator=gen).tolist()
        tables = [order[sum(need[:i]):sum(need[:i + 1])] for i in range(len(requests))]
        shape = (spec.num_kv_heads, spec.head_size)
        keys = [torch.randn(n, *shape, generator=gen, dtype=torch.float64).to(spec.dtype) for n in seqs]
        values = [torch.randn(n, *shape, generator=gen, dtype=torch.float64).to(spec.dtype) for n in seqs]
        query = torch.randn(sum(q for _, q in requests), spec.num_heads, spec.head_size, generator=gen,
                            dtype=torch.float64).to(spec.dtype)
        slots = [[t[p // bs] * bs + p % bs for p in range(n)] for t, n in zip(tables, seqs)]

        def rows(parts: list[torch.Tensor], new: bool) -> torch.Tensor:
            return torch.cat([x[c:] if new else x[:c] for x, (c, _) in zip(parts, requests)]).to(dev)

        cache = backend.allocate_kv_cache(len(order))
        old_slots = torch.tensor([s for sl, (c, _) in zip(slots, requests) for s in sl[:c]], dtype=torch.int64)
        backend.write_kv(rows(keys, False), rows(values, False), cache, old_slots.to(dev))
        inputs = requests_step([c for c, _ in requests], [q for _, q in requests], tables, bs, dev)
        out = torch.full(query.shape, float("nan"), dtype=spec.dtype, device=dev)
        backend.forward(query.to(dev), rows(keys, True), rows(values, True), cache, backend.plan(inputs.batch), out=out)
        got = out.detach().cpu().to(torch.float64)

        def paged(parts: list[torch.Tensor]) -> torch.Tensor:
            flat = torch.zeros(len(order) * bs, *shape, dtype=torch.float64)
            for sl, x in zip(slots, parts):
                flat[sl] = x.to(torch.float64)
            return flat.view(len(order), bs, *shape)

        def attend(k: list[torch.Tensor], v: list[torch.Tensor]) -> torch.Tensor:
            return paged_attention_reference(query, paged(k), paged(v), tables, [c for c, _ in requests],
                                             [q for _, q in requests], spec.softmax_scale)

        rounded = attend([fake_quant(k, kv, KV_SCALES[0]) for k in keys], [fake_quant(v, kv, KV_SCALES[1]) for v in values])
        exact = attend(keys, values)
        problems, row = [], 0
        tol = TOLERANCES[dtype_name(spec.dtype)][1]
        for i, (ctx, qlen) in enumerate(requests):
            o, r, e = got[row:row + qlen], rounded[row:row + qlen], exact[row:row + qlen]
            ok, how = within(dtype_name(spec.dtype), o, r)
            if not ok:
                problems.append(f"request {i} (context {ctx}, query {qlen}) against attention over the reference-rounded "
                                f"{kv} K/V: {how}")
            bound = attention_bound(query[row:row + qlen], keys[i], values[i], element_bound(keys[i], kv, KV_SCALES[0]),
                                    element_bound(values[i], kv, KV_SCALES[1]), ctx, spec.softmax_scale)
            excess = (o - e).abs() - bound - tol * e.abs().max()
            if (excess > 0).any():
                worst = int(excess.flatten().argmax())
                problems.append(f"request {i} (context {ctx}, query {qlen}) against unquantized attention: |error| "
                                f"{(o - e).abs().flatten()[worst]:.3g} above the {kv} bound {bound.flatten()[worst]:.3g} "
                                f"at element {worst}")
            row += qlen
        if problems:
            _fail(case, f"kv_cache_dtype {kv} (fp8 scales k {KV_SCALES[0]}, v {KV_SCALES[1]})", problems)

    def test_unsupported(self, case: Case) -> None:
        """A combination the backend did not declare raises ``corerun.UnsupportedError`` at construction."""
        self.start(case)
        cfg, what, device = case.config
        spec = cfg.spec(device or case.device)
        try:
            backend = case.target.create(spec)
        except UnsupportedError:
            return
        except Exception as exc:
            pytest.fail(
                f"building for {what} (undeclared) raised {type(exc).__name__}: {exc}; "
                "it must raise corerun.UnsupportedError naming what is unsupported",
                pytrace=False,
            )
        pytest.fail(
            f"{case.target.label} does not declare {what} ({case.target.capabilities}) but "
            f"constructed {type(backend).__name__} for it; undeclared combinations must raise corerun.UnsupportedError",
            pytrace=False,
        )
