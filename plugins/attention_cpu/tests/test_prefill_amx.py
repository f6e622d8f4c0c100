"""The AMX prefill call (``csrc/prefill_amx.cpp``) against a float64 causal-attention definition, alone and
through the backend's ``forward`` beside decodes and partly cached prompts; its refusals and its route.

Error bound.  The scores are exact bfloat16 products summed in float32; each probability p is rounded to
bfloat16 (8 significant bits: relative error <= u = 2^-8) before O += P V and the divisor sums the
unrounded p, so the computed row differs from sum(p v) / sum(p) by at most u * max|v| over the row's keys;
the result is then rounded to bfloat16 (u * |o|).  Each element is checked against u * (max|v| + |o|) plus
1e-4 * max|v| for the float32 sums and the polynomial exp2, and the whole output against the bfloat16
conformance tolerance (rms 4e-3 relative); the rounding errors of a row average out, so the rms error seen
is far under both (about 2e-3, mostly the rounding of the result).  Skipped where the CPU or the build has no AMX-BF16.
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from corerun_attention_cpu import backend as backend_module, kernels
from corerun_attention_cpu.backend import CpuAttentionBackend
from cpu_attn_cases import TOLERANCE, make_spec, make_step, needs_compiler, reference, relative_errors


def _amx_here() -> bool:
    if kernels.find_compiler()[0] is None:
        return False
    lib, _ = kernels.load()
    return bool(lib is not None and lib.corerun_cpu_prefill_amx_available())


needs_amx = pytest.mark.skipif(not _amx_here(), reason="no AMX-BF16 here (CPU, kernel grant or build): the SDPA route is used")

LENGTHS = (1, 15, 17, 31, 33, 100, 257, 600)


def _definition(q, k, v, ranges, scale):
    """float64 causal attention of each prompt over its own keys; rows outside every prompt NaN."""
    g = q.shape[1] // k.shape[1]
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    vmax = torch.full(q.shape[:2], float("nan"), dtype=torch.float64)  # max |v| over the row's prompt and KV head
    for s, e in ranges:
        n = e - s
        qq = q[s:e].double().transpose(0, 1)
        kk = k[s:e].double().transpose(0, 1).repeat_interleave(g, 0)
        vv = v[s:e].double().transpose(0, 1).repeat_interleave(g, 0)
        scores = (qq @ kk.transpose(1, 2)) * scale
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        out[s:e] = (scores.softmax(-1) @ vv).transpose(0, 1)
        vmax[s:e] = vv.abs().amax(dim=(1, 2))[None, :]
    return out, vmax


def _call(lib, q, k, v, out, ranges, scale, threads=2):
    r = torch.tensor(ranges, dtype=torch.int32).reshape(-1, 2)
    err = (ctypes.c_int64 * 4)()
    rc = lib.corerun_cpu_prefill_amx(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
        v.stride(1), out.data_ptr(), out.stride(0), out.stride(1), r.data_ptr(), r.shape[0], q.shape[0],
        q.shape[1], k.shape[1], q.shape[2], scale, threads, ctypes.addressof(err),
    )
    return rc, list(err)


def _check(out, ref, vmax):
    rows = ~torch.isnan(ref[..., 0])
    assert torch.isnan(out[~rows]).all(), "a row outside every prompt was written"
    o, r = out[rows].double(), ref[rows]
    assert torch.isfinite(o).all(), "rows left unwritten (NaN poison survived)"
    bound = 2.0**-8 * (vmax[rows][..., None] + r.abs()) + 1e-4 * vmax[rows][..., None]
    worst = ((o - r).abs() / bound).max().item()
    assert worst <= 1.0, f"error {worst:.2f}x the bound"
    rms = ((o - r).norm() / r.norm()).item()
    assert rms <= TOLERANCE[torch.bfloat16][0], rms


@needs_amx
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 2)], ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("head_size", [64, 128])
def test_odd_lengths_in_one_call_match_the_definition(heads, kv_heads, head_size):
    lib, _ = kernels.load()
    gen = torch.Generator().manual_seed(heads * 1000 + head_size)
    lengths = LENGTHS if head_size == 64 else LENGTHS[:-1]  # (keeps the float64 reference quick)
    gaps = [3, 0, 5, 0, 1, 0, 2, 0]  # rows between prompts that no prompt owns: left as they were
    ranges, at = [], 0
    for n, gap in zip(lengths, gaps):
        at += gap
        ranges.append((at, at + n))
        at += n
    total = at + 4
    rnd = lambda *shape: (torch.randn(*shape, generator=gen, dtype=torch.float64) * 2).bfloat16()  # noqa: E731
    # q / k / v as views of one fused projection (row stride > heads * head_size), out strided too
    qkv = rnd(total, heads + 2 * kv_heads, head_size)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    out_full = torch.full((total, heads + 1, head_size), float("nan"), dtype=torch.bfloat16)
    out = out_full[:, 1:]
    scale = head_size**-0.5
    assert _call(lib, q, k, v, out, ranges, scale) == (0, [0, 0, 0, 0])
    ref, vmax = _definition(q, k, v, ranges, scale)
    _check(out, ref, vmax)
    assert torch.isnan(out_full[:, 0]).all(), "written outside the output's view"


@needs_amx
def test_one_and_two_threads_give_the_same_bits():
    lib, _ = kernels.load()
    gen = torch.Generator().manual_seed(7)
    ranges = [(0, 300), (300, 333), (333, 350)]
    q, k, v = (torch.randn(350, h, 64, generator=gen).bfloat16() for h in (9, 3, 3))
    outs = []
    for threads in (1, 2):
        out = torch.full_like(q, float("nan"))
        assert _call(lib, q, k, v, out, ranges, 0.125, threads)[0] == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@needs_amx
def test_refusals():
    lib, _ = kernels.load()
    q, k, v = (torch.randn(40, h, 80).bfloat16() for h in (4, 2, 2))
    out = torch.full_like(q, float("nan"))
    assert _call(lib, q, k, v, out, [(0, 40)], 0.1) == (5, [5, 0, 80, 0])  # head size 80: the backend falls back
    q, k, v = (torch.randn(40, h, 64).bfloat16() for h in (4, 2, 2))
    assert _call(lib, q, k, v, out[..., :64], [(0, 20), (20, 41)], 0.1) == (1, [1, 1, 20, 41])
    assert _call(lib, q, k, v, out[..., :64], [(30, 20)], 0.1) == (1, [1, 0, 30, 20])
    assert torch.isnan(out).all(), "a refused call wrote"


# (cached context, new tokens) per request, decodes first: fresh prompts of odd lengths between decodes and
# partly cached prompts; (0, 1) and (0, 15) are fresh but shorter than AMX_MIN_TOKENS (the paged kernel)
MIXED = [(300, 1), (0, 1), (47, 1), (0, 17), (16, 150), (0, 600), (5, 3), (0, 15), (0, 257), (40, 33), (0, 100), (0, 31)]


@needs_amx
@pytest.mark.parametrize("kw", [dict(), dict(num_heads=8, num_kv_heads=2, head_size=128), dict(num_heads=4, num_kv_heads=4)],
                         ids=["gqa3-hd64", "gqa4-hd128", "mha-hd64"])
def test_forward_routes_fresh_prompts_to_one_amx_call(kw, monkeypatch):
    spec = make_spec(dtype=torch.bfloat16, **kw)
    backend = CpuAttentionBackend(spec)
    assert backend.amx_prefill
    step = make_step(backend, spec, MIXED, seed=11)
    md = backend.plan(step.batch)
    qsl = step.batch.query_start_loc.tolist()
    fresh = tuple((qsl[i], qsl[i + 1]) for i, (c, n) in enumerate(MIXED) if c == 0 and n >= backend_module.AMX_MIN_TOKENS)
    assert md.fresh_prompts == fresh and md.fresh_amx is not None and md.fresh_amx.tolist() == [list(r) for r in fresh]
    calls = []
    monkeypatch.setattr(backend, "lib", _Recording(backend.lib, calls))
    monkeypatch.setattr(backend, "_attend_fresh", lambda *a: pytest.fail("SDPA called with AMX present"))
    out = torch.full_like(step.query, float("nan"))
    backend.forward(step.query, step.key, step.value, step.cache, md, out=out)
    assert calls == [len(fresh)], "not one AMX call for all of the step's fresh prompts"
    assert torch.isfinite(out).all(), "rows left unwritten (NaN poison survived)"
    rms, mx = relative_errors(out, reference(backend, spec, step))
    assert rms <= TOLERANCE[torch.bfloat16][0] and mx <= TOLERANCE[torch.bfloat16][1], (rms, mx)


class _Recording:
    """The library, with the number of prompts of each AMX call recorded."""

    def __init__(self, lib, calls):
        self._lib, self._calls = lib, calls

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        if name != "corerun_cpu_prefill_amx":
            return fn

        def recorded(*args):
            self._calls.append(args[13])
            return fn(*args)

        return recorded


@needs_compiler
def test_no_amx_keeps_the_sdpa_route(monkeypatch):
    """On a CPU with AMX-BF16, a library without the AMX path plans for SDPA; a refusal at run time falls back."""
    spec = make_spec(dtype=torch.bfloat16)
    backend = CpuAttentionBackend(spec)
    step = make_step(backend, spec, [(3, 1), (0, 200), (0, 40)], seed=5)
    backend.amx_prefill = False
    backend.sdpa_min_tokens = backend_module.sdpa_min_tokens(torch.bfloat16, frozenset({"amx_bf16"}))
    md = backend.plan(step.batch)
    assert md.fresh_prompts == ((1, 201),) and md.fresh_amx is None
    backend.amx_prefill = True
    md = backend.plan(step.batch)
    assert md.fresh_prompts == ((1, 201), (201, 241)) and md.fresh_amx is not None
    monkeypatch.setattr(backend, "lib", _Refusing(backend.lib))  # a library that says "no AMX here" at run time
    out = torch.full_like(step.query, float("nan"))
    backend.forward(step.query, step.key, step.value, step.cache, md, out=out)
    assert not backend.amx_prefill
    rms, mx = relative_errors(out, reference(backend, spec, step))
    assert rms <= TOLERANCE[torch.bfloat16][0] and mx <= TOLERANCE[torch.bfloat16][1], (rms, mx)


class _Refusing:
    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        if name == "corerun_cpu_prefill_amx":
            return lambda *args: backend_module.AMX_NO_AMX
        return getattr(self._lib, name)


@needs_compiler
@pytest.mark.parametrize("kw", [dict(dtype=torch.float32), dict(dtype=torch.bfloat16, head_size=80)], ids=["fp32", "bf16-hd80"])
def test_amx_route_only_for_bfloat16_head_sizes_it_takes(kw):
    assert not CpuAttentionBackend(make_spec(**kw)).amx_prefill


@needs_amx
def test_a_refused_call_through_the_backend_names_the_prompt_and_its_range():
    backend = CpuAttentionBackend(make_spec(dtype=torch.bfloat16))
    s = backend.spec
    q = torch.randn(40, s.num_heads, s.head_size).bfloat16()
    k, v = (torch.randn(40, s.num_kv_heads, s.head_size).bfloat16() for _ in range(2))
    out = torch.full_like(q, float("nan"))
    ranges = torch.tensor([[0, 20], [20, 41]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"fresh prompt 1's query range \[20, 41\) is not within the step's 40 tokens"):
        backend._attend_fresh_amx(q, k, v, out, ranges)
    assert torch.isnan(out).all()
