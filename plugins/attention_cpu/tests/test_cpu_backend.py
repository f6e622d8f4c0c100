"""The ``cpu`` backend against an independent float64 reference on batches larger than the
conformance suite's (long prefills cut into several tiles, hundreds of keys, odd group sizes and
head sizes), its refusals, and its thread-count independence."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from corerun.errors import UnsupportedError
from corerun_attention_cpu import backend as backend_module, kernels
from corerun_attention_cpu.backend import CpuAttentionBackend
from cpu_attn_cases import TOLERANCE, make_spec, make_step, needs_compiler, reference, relative_errors

CASES = {
    # name: (spec keywords, requests (cached context, new tokens) with decodes first)
    "default-model-mixed": (dict(), [(300, 1), (0, 1), (47, 1), (16, 150), (0, 70), (5, 3)]),
    "long-prefill-mha": (dict(num_heads=4, num_kv_heads=4, head_size=32, block_size=8), [(0, 200), (13, 97)]),
    "gqa7-hd40-bs128": (dict(num_heads=14, num_kv_heads=2, head_size=40, block_size=128), [(130, 1), (255, 1), (120, 33)]),
    "mqa-hd256-bs32": (dict(num_heads=8, num_kv_heads=1, head_size=256, block_size=32), [(63, 1), (64, 1), (31, 40)]),
    "decodes-only": (dict(head_size=80), [(c, 1) for c in (1, 15, 16, 17, 400, 33, 0)]),
    # 32 decodes (one item per request): full blocks of 16 keys through the all-register path (in bfloat16
    # with AVX512_BF16, the keys read as stored), head sizes 64 and 128
    "decodes-32": (dict(), [(31 + 15 * i, 1) for i in range(32)]),
    "decodes-32-hd128": (dict(num_heads=8, num_kv_heads=2, head_size=128), [(31 + 15 * i, 1) for i in range(32)]),
    # the one-token path's query-head groups per KV head: 4 at once (hd 64), 4 + 1, and 2 + 1 (hd 128);
    # partial last blocks of every length; three decodes (one item per KV head)
    "decodes-gqa4": (dict(num_heads=8, num_kv_heads=2), [(c, 1) for c in range(0, 320, 19)]),
    "decodes-gqa5": (dict(num_heads=10, num_kv_heads=2), [(c, 1) for c in range(3, 320, 21)]),
    "decodes-gqa3-hd128": (dict(num_heads=6, num_kv_heads=2, head_size=128), [(c, 1) for c in range(5, 320, 23)]),
    "three-decodes": (dict(), [(200, 1), (16, 1), (33, 1)]),
    # prefills whose last tile (32 tokens of 3 heads) holds one token, and a decode after them
    "one-token-tiles": (dict(), [(0, 1), (40, 33), (7, 65), (0, 33)]),
    # prompts with nothing cached (in bfloat16 on a CPU with AMX through corerun's AMX call or torch's SDPA, the
    # requests between them through the kernel)
    "fresh-prompts-mixed": (dict(), [(300, 1), (0, 70), (16, 150), (0, 300), (0, 20), (0, 64)]),
    "fresh-prompts-only-mha-hd128": (dict(num_heads=4, num_kv_heads=4, head_size=128), [(0, 200), (0, 65)]),
    # the kernel's prefill tiles (block size 16, head size 64 / 128): prompts of several lengths in one step,
    # some partly cached (chunked prefill), groups of 3, 4 and 5 query heads (tiles of 96 rows)
    "prefill-tiles-gqa3": (dict(), [(0, 33), (40, 230), (17, 5), (0, 256), (100, 64), (0, 2)]),
    "prefill-tiles-gqa4-hd128": (dict(num_heads=8, num_kv_heads=2, head_size=128), [(0, 97), (33, 150), (0, 2), (250, 17)]),
    "prefill-tiles-gqa5": (dict(num_heads=10, num_kv_heads=2), [(7, 61), (0, 129), (64, 64)]),
    # a float32 prompt long enough for SDPA, beside a short one through the kernel
    "fresh-prompt-fp32-sdpa": (dict(), [(0, 2100), (3, 40)]),
}


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_float64_reference(case, dtype):
    kw, requests = CASES[case]
    spec = make_spec(dtype=dtype, **kw)
    backend = CpuAttentionBackend(spec)
    step = make_step(backend, spec, requests, seed=len(case))
    out = torch.full_like(step.query, float("nan"))
    result = backend.forward(step.query, step.key, step.value, step.cache, backend.plan(step.batch), out=out)
    assert result is out
    k, v = backend.kv_cache_view(step.cache)
    slots = step.batch.slot_mapping
    bs = spec.block_size
    assert torch.equal(k[slots // bs, slots % bs], step.key) and torch.equal(v[slots // bs, slots % bs], step.value)
    assert torch.isfinite(out).all(), "rows left unwritten (NaN poison survived)"
    rms, mx = relative_errors(out, reference(backend, spec, step))
    tol_rms, tol_max = TOLERANCE[dtype]
    assert rms <= tol_rms and mx <= tol_max, (rms, mx)


@needs_compiler
@pytest.mark.parametrize(
    "requests, fresh, kernel_runs",
    [
        ([(300, 1), (0, 70), (16, 150), (0, 300), (0, 20), (0, 64)], ((1, 71), (221, 521), (541, 605)), ((0, 1), (2, 3), (4, 5))),
        ([(5, 3), (0, 63)], (), ()),  # a context, a prompt too short
        ([(0, 200), (0, 65)], ((0, 200), (200, 265)), ()),
    ],
)
def test_bf16_plan_sends_the_fresh_prompts_to_sdpa(requests, fresh, kernel_runs):
    backend = CpuAttentionBackend(make_spec(dtype=torch.bfloat16))
    backend.amx_prefill = False  # the route without AMX (tests/test_prefill_amx.py covers the other)
    backend.sdpa_min_tokens = 64  # as on a CPU with AMX-BF16 (the threshold lowered to fit the cases)
    batch = make_step(backend, backend.spec, requests).batch
    md = backend.plan(batch)
    assert (md.fresh_prompts, md.kernel_runs) == (fresh, kernel_runs)
    assert md.fresh_amx is None
    assert CpuAttentionBackend(make_spec(dtype=torch.float32)).plan(batch).fresh_prompts == ()


def test_bf16_prompts_go_to_sdpa_only_on_a_cpu_with_amx():
    """Without AMX-BF16 torch's SDPA is behind the kernel at every length in bfloat16 (backend docstring)."""
    amd_epyc = frozenset({"avx512f", "avx512_bf16", "avx512_vnni"})
    sapphire_rapids = amd_epyc | {"amx_bf16", "amx_tile", "amx_int8"}
    assert backend_module.sdpa_min_tokens(torch.bfloat16, amd_epyc) is None
    assert backend_module.sdpa_min_tokens(torch.bfloat16, sapphire_rapids) == 128
    for flags in (amd_epyc, sapphire_rapids):
        assert backend_module.sdpa_min_tokens(torch.float32, flags) == 2048
        assert backend_module.sdpa_min_tokens(torch.float16, flags) is None


@needs_compiler
def test_bf16_plan_keeps_fresh_prompts_in_the_kernel_without_amx():
    backend = CpuAttentionBackend(make_spec(dtype=torch.bfloat16))
    backend.amx_prefill, backend.sdpa_min_tokens = False, None  # an AMD EPYC
    md = backend.plan(make_step(backend, backend.spec, [(0, 300), (16, 150), (0, 200)]).batch)
    assert (md.fresh_prompts, md.kernel_runs, md.fresh_amx) == ((), (), None)


@needs_compiler
def test_bf16_refusal_between_fresh_prompts_names_the_request():
    spec = make_spec(dtype=torch.bfloat16)
    backend = CpuAttentionBackend(spec)
    step = make_step(backend, spec, [(0, 70), (20, 3), (0, 80)])
    step.batch.block_tables[1, 0] = 10**6
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\] = 1000000 is not a block of this cache"):
        backend.forward(step.query, step.key, step.value, step.cache, backend.plan(step.batch))


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_size", [64, 128])
def test_prefill_tiles_ignore_non_finite_slots_past_the_sequence(dtype, head_size):
    """A block's slots past a request's last token hold whatever an earlier request left there, NaN or inf
    included: the tiles mask those keys and read their V rows as zeros (never 0 * inf)."""
    heads, kv_heads = (9, 3) if head_size == 64 else (6, 2)
    spec = make_spec(dtype=dtype, num_heads=heads, num_kv_heads=kv_heads, head_size=head_size)
    backend = CpuAttentionBackend(spec)
    backend.sdpa_min_tokens = None  # every prompt through the kernel's tiles
    step = make_step(backend, spec, [(0, 37), (20, 45), (0, 90)], seed=7)
    k, v = backend.kv_cache_view(step.cache)
    bs = spec.block_size
    for i, (ctx, qlen) in enumerate(step.requests):
        last = int(step.batch.block_tables[i, (ctx + qlen - 1) // bs])
        k[last, (ctx + qlen) % bs or bs:] = float("inf")
        v[last, (ctx + qlen) % bs or bs:] = float("nan")
    out = backend.forward(step.query, step.key, step.value, step.cache, backend.plan(step.batch))
    assert torch.isfinite(out).all()
    rms, mx = relative_errors(out, reference(backend, spec, step))
    assert rms <= TOLERANCE[dtype][0] and mx <= TOLERANCE[dtype][1], (rms, mx)


@needs_compiler
def test_same_bits_on_one_and_two_threads():
    """Each (request, KV head, tile) is computed by one thread in a fixed order: the thread count cannot change a bit."""
    spec = make_spec(dtype=torch.bfloat16)
    backend = CpuAttentionBackend(spec)
    step = make_step(backend, spec, [(200, 1), (31, 1), (0, 90), (40, 20)], seed=3)
    md = backend.plan(step.batch)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(backend.forward(step.query, step.key, step.value, step.cache, md))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


@needs_compiler
def test_strided_query_and_returned_out():
    """A query that is a view into a fused QKV tensor, no ``out``: the result is a new tensor of the query's shape."""
    spec = make_spec(num_heads=4, num_kv_heads=2, head_size=32)
    backend = CpuAttentionBackend(spec)
    step = make_step(backend, spec, [(20, 1), (0, 9)], seed=5)
    fused = torch.randn(step.query.shape[0], 8, 32)
    fused[:, :4] = step.query
    query = fused[:, :4]
    assert not query.is_contiguous()
    out = backend.forward(query, step.key, step.value, step.cache, backend.plan(step.batch))
    assert out.shape == step.query.shape
    rms, mx = relative_errors(out, reference(backend, spec, step))
    assert rms < 2e-6 and mx < 2e-5


@needs_compiler
def test_block_id_outside_the_cache_is_refused_by_name():
    spec = make_spec()
    backend = CpuAttentionBackend(spec)
    step = make_step(backend, spec, [(40, 1), (3, 5)], seed=1)
    num_blocks = step.cache.shape[1]
    step.batch.block_tables[1, 0] = num_blocks + 7
    with pytest.raises(ValueError, match=rf"block_tables\[1, 0\] = {num_blocks + 7} is not a block of this cache \(valid: 0 .. {num_blocks - 1}\)"):
        backend.forward(step.query, step.key, step.value, step.cache, backend.plan(step.batch))


@needs_compiler
def test_table_too_narrow_and_short_sequence_are_refused():
    spec = make_spec(block_size=8)
    backend = CpuAttentionBackend(spec)
    step = make_step(backend, spec, [(40, 1)], seed=2)
    narrow = backend.plan(replace(step.batch, block_tables=step.batch.block_tables[:, :2]))
    with pytest.raises(ValueError, match=r"request 0 needs 6 blocks of 8 tokens, but block_tables has 2 columns"):
        backend.forward(step.query, step.key, step.value, step.cache, narrow)
    short = backend.plan(replace(step.batch, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                                 seq_lens=torch.tensor([0], dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 0 is shorter than request 0's 1 query tokens"):
        backend.forward(step.query, step.key, step.value, step.cache, short)


@needs_compiler
def test_slot_outside_the_cache_writes_nothing():
    spec = make_spec(num_heads=2, num_kv_heads=2, head_size=32, block_size=4)
    backend = CpuAttentionBackend(spec)
    cache = backend.allocate_kv_cache(3)
    before = cache.clone()
    key = torch.randn(3, 2, 32)
    with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 12 is outside the cache \(valid: -1 for none, or 0 .. 11"):
        backend.write_kv(key, key, cache, torch.tensor([0, -1, 12]))
    assert torch.equal(cache, before)


@pytest.mark.parametrize(
    "kw, reason",
    [
        (dict(dtype=torch.float64), "dtype float64 not in"),
        (dict(head_size=320), "head size 320 above the maximum 256"),
        (dict(num_heads=9, num_kv_heads=2), "num_heads 9 is not a multiple of num_kv_heads 2"),
    ],
)
def test_undeclared_specs_are_refused(kw, reason):
    with pytest.raises(UnsupportedError, match=reason):
        CpuAttentionBackend(make_spec(**kw))


def test_device_other_than_cpu_is_refused():
    spec = make_spec()
    cuda = type(spec)(**{**spec.__dict__, "device": torch.device("cuda")})
    with pytest.raises(UnsupportedError, match="device cuda not in"):
        CpuAttentionBackend(cuda)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty build cache and a forgotten library; the real one is loaded again afterwards."""
    monkeypatch.setenv("CORERUN_CACHE_DIR", str(tmp_path))
    kernels.reset()
    yield tmp_path
    kernels.reset()


def test_without_a_compiler_the_probe_says_why_and_the_factory_refuses(monkeypatch, fresh_build):
    from corerun_attention_cpu.probe import probe

    monkeypatch.setenv("CXX", "no-such-compiler-here")
    reasons = probe()
    assert reasons == ["$CXX='no-such-compiler-here' is not an executable on PATH"]
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(fresh_build))  # no c++, g++ or clang++ anywhere
    kernels.reset()
    with pytest.raises(UnsupportedError, match=r"no C\+\+ compiler found"):
        CpuAttentionBackend(make_spec())


def test_a_failing_compiler_is_reported_with_its_output(monkeypatch, fresh_build):
    fake = fresh_build / "fake-cxx"
    fake.write_text("#!/bin/sh\necho 'fake-cxx: error: cannot compile today' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    _, reasons = kernels.load()
    assert len(reasons) == 2  # with OpenMP, then without
    assert all("exit status 3: fake-cxx: error: cannot compile today" in r for r in reasons)
    assert not list(fresh_build.rglob("*.so")), "a failed build left a file behind"


@needs_compiler
def test_build_is_cached_by_key(fresh_build):
    lib, reasons = kernels.load()
    assert lib is not None and not reasons
    built = list(fresh_build.rglob(kernels.LIB_NAME))
    assert len(built) == 1 and built[0].parent.parent == fresh_build / "attention_cpu"
    mtime = built[0].stat().st_mtime_ns
    kernels.reset()
    assert kernels.load()[0] is not None
    assert built[0].stat().st_mtime_ns == mtime  # loaded again, not rebuilt


@needs_compiler
def test_an_unwritable_build_folder_is_a_reason(monkeypatch, fresh_build):
    blocker = fresh_build / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("CORERUN_CACHE_DIR", str(blocker))
    _, reasons = kernels.load()
    assert reasons and all("cannot write to the build folder" in r and "CORERUN_CACHE_DIR" in r for r in reasons)


@needs_compiler
def test_one_openmp_runtime_after_the_kernels_load():
    """The kernels share torch's OpenMP runtime (torch/lib's libgomp where torch ships one): one in the process."""
    from corerun.testing import openmp_runtimes

    lib, why = kernels.load()
    assert lib is not None, why
    runtimes = openmp_runtimes()
    assert len(runtimes) == 1, f"OpenMP runtimes mapped into the process: {runtimes}"
    torch_gomp = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    if lib.corerun_cpu_openmp() and torch_gomp:
        assert Path(runtimes[0]).resolve() == torch_gomp[0].resolve()
