"""CPU speed settings that must not change results: oneDNN-prepacked linear weights, and ``threads``.

The prepacked path is checked against a float64 matmul of the same numbers (and against itself
after the weight changes in place); the physical-core count against hand-written ``/proc/cpuinfo``
texts whose answer is known; ``threads`` against torch's pool after an engine starts.
"""

from __future__ import annotations

import pytest
import torch

from corerun.config import load_config
from corerun.errors import ConfigError
from corerun.models.layers import MATMUL_MIN_ROWS, Linear, LMHead, PackedWeight
from corerun.platform import host
from corerun.platform.host import (
    AUTO_PARALLEL_TOKENS, AUTO_PARALLEL_TOKENS_BF16_NO_AMX, AUTO_PARALLEL_TOKENS_FLOAT32, cpu_vendor, parallel_tokens, physical_cores, resolve_threads,
    step_pools, step_threads,
)
from tests.helpers.tiny_models import make_tiny_model

needs_mkldnn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


@needs_mkldnn
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_prepacked_float32_linear_matches_float64(rows):
    g = torch.Generator().manual_seed(rows)
    layer = Linear(96, 200, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(200, 96, generator=g))
        layer.bias.copy_(torch.randn(200, generator=g))
    x = torch.randn(rows, 96, generator=g)
    with torch.inference_mode():
        y = layer(x)
    assert layer.packed.packed is not None  # the packed path ran
    ref = x.double() @ layer.weight.double().T + layer.bias.double()
    assert y.shape == (rows, 200) and y.dtype == torch.float32 and torch.isfinite(y).all()
    assert _rel(y, ref) < 1e-6


@needs_mkldnn
def test_prepacked_bfloat16_linear_matches_float64():
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no oneDNN bfloat16 path")
    g = torch.Generator().manual_seed(1)
    head = LMHead(300, 64).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(300, 64, generator=g))
    x = torch.randn(5, 64, generator=g).bfloat16()
    with torch.inference_mode():
        y = head(x)
    assert head.packed.packed is not None and y.dtype == torch.float32
    ref = x.double() @ head.weight.double().T  # bfloat16 inputs, exact products, float32 accumulation
    assert _rel(y, ref) < 4e-3


@needs_mkldnn
def test_a_weight_changed_in_place_is_packed_again():
    layer = Linear(32, 16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(16, 32))
    x = torch.randn(3, 32)
    with torch.inference_mode():
        layer(x)
    first = layer.packed.packed
    with torch.no_grad():
        layer.weight.mul_(-2.0)
    with torch.inference_mode():
        y = layer(x)
    assert layer.packed.packed is not first
    assert _rel(y, x.double() @ layer.weight.double().T) < 1e-6


def test_prepacking_off_and_autograd_use_plain_linear(monkeypatch):
    monkeypatch.setenv("CORERUN_CPU_PREPACK", "0")
    layer = Linear(8, 4)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(4, 8))
    x = torch.randn(2, 8)
    assert _rel(layer(x), x.double() @ layer.weight.double().T) < 1e-6 and layer.packed.packed is None
    monkeypatch.delenv("CORERUN_CPU_PREPACK")
    xg = torch.randn(2, 8, requires_grad=True)
    layer(xg).sum().backward()  # the packed op has no backward: autograd takes F.linear
    assert layer.packed.packed is None and torch.allclose(xg.grad, layer.weight.sum(0).expand(2, 8))
    assert PackedWeight().linear(x.double(), layer.weight.double(), None).dtype == torch.float64  # float64: F.linear


def _cpuinfo(entries):
    return "\n\n".join(f"processor\t: {p}\nphysical id\t: {s}\ncore id\t\t: {c}\nflags\t\t: avx2" for p, s, c in entries) + "\n"


def test_physical_cores_from_cpuinfo():
    # 2 sockets x 2 cores x 2 hyper-threads: processors 0-7, siblings (0, 4), (1, 5), (2, 6), (3, 7)
    entries = [(p, p % 4 // 2, p % 2) for p in range(8)]
    text = _cpuinfo(entries)
    assert physical_cores(text, allowed=set(range(8))) == 4
    assert physical_cores(text, allowed={0, 4}) == 1  # two hyper-threads of one core
    assert physical_cores(text, allowed={0, 1, 2}) == 3
    assert physical_cores("processor\t: 0\n\nprocessor\t: 1\n", allowed={0, 1}) == 2  # no core ids: the CPUs


def test_resolve_threads():
    cores = physical_cores()
    assert resolve_threads("auto") == cores and resolve_threads(3) == 3
    assert resolve_threads("auto", world_size=cores * 2) == 1
    for bad in (0, -1, True, "4"):
        with pytest.raises(ValueError, match="threads must be"):
            resolve_threads(bad)


def test_step_threads():
    big = AUTO_PARALLEL_TOKENS
    assert [step_threads(n, 4, auto=True) for n in (1, 32, big - 1, big, 4 * big)] == [1, 1, 1, 4, 4]
    assert {step_threads(n, 3, auto=False) for n in (1, big, 4 * big)} == {3}  # an integer setting: every step
    assert step_pools(4, auto=True) == (1, 4) and step_pools(3, auto=False) == (3, 3)  # (below, from) 512 tokens
    sapphire_rapids = "processor\t: 0\nflags\t\t: avx512f avx512_bf16 amx_bf16 amx_tile\n"
    amd_epyc = "processor\t: 0\nflags\t\t: avx512f avx512_bf16 avx512_vnni\n"
    assert parallel_tokens("float32") == AUTO_PARALLEL_TOKENS_FLOAT32 < 32
    assert parallel_tokens("bfloat16", sapphire_rapids) == big  # AMX: one thread streams the weights
    assert parallel_tokens("bfloat16", amd_epyc) == AUTO_PARALLEL_TOKENS_BF16_NO_AMX < 16  # compute-bound products
    assert parallel_tokens("float16", amd_epyc) == big
    assert [step_threads(n, 2, True, parallel_tokens("float32")) for n in (1, 3, 4, 16)] == [1, 1, 2, 2]
    assert [step_threads(n, 2, True, parallel_tokens("bfloat16", amd_epyc)) for n in (1, 4)] == [2, 2]
    # a quantization method's own size (its parallel_tokens): the smaller of the two
    assert parallel_tokens("float32", products=1) == 1 and parallel_tokens("float32", products=64) == AUTO_PARALLEL_TOKENS_FLOAT32
    assert parallel_tokens("bfloat16", sapphire_rapids, products=16) == 16 and parallel_tokens("float16", products=None) == big


def test_auto_sizes_each_step_and_an_integer_does_not(tmp_path):
    from corerun import LLM, SamplingParams

    model = str(make_tiny_model(tmp_path))
    seen: list[tuple[int, int]] = []
    saved = torch.get_num_threads()
    try:
        for setting in ("auto", 2):
            llm = LLM(model=model, device="cpu", dtype="float32", attention="torch", threads=setting, quantization="none",
                      kv_cache={"num_blocks": 8}, scheduler={"max_model_len": 64})
            forward = llm.engine.runner._forward

            def spy(inputs, forward=forward):
                seen.append((int(inputs.input_ids.numel()), torch.get_num_threads()))
                return forward(inputs)

            llm.engine.runner._forward = spy
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
        pool = resolve_threads("auto")
        assert seen[:3] == [(3, 1), (1, 1), (1, 1)]  # auto: small steps on one thread
        assert seen[3:] == [(3, 2), (1, 2), (1, 2)]  # 2: as set
        assert host.step_threads(AUTO_PARALLEL_TOKENS, pool, auto=True) == pool
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_runs_a_step_of_parallel_tokens_on_every_thread(tmp_path, dtype):
    """In float32 a step of AUTO_PARALLEL_TOKENS_FLOAT32 tokens (a 4-request decode, a short prompt) takes the
    whole pool and a one-token step one thread; in bfloat16 on a CPU without AMX (parallel_tokens) every step
    takes the pool, with AMX both stay on one thread.  ``quantization: none``: the dtype's own rule (a method may
    lower it, its ``parallel_tokens``; corerun-quant-cpu's tests check dense_cpu's)."""
    from corerun import LLM, SamplingParams

    seen: list[tuple[int, int]] = []
    saved = torch.get_num_threads()
    try:
        llm = LLM(model=str(make_tiny_model(tmp_path)), device="cpu", dtype=dtype, attention="torch", threads="auto",
                  quantization="none", kv_cache={"num_blocks": 8}, scheduler={"max_model_len": 64})
        forward = llm.engine.runner._forward

        def spy(inputs):
            seen.append((int(inputs.input_ids.numel()), torch.get_num_threads()))
            return forward(inputs)

        llm.engine.runner._forward = spy
        prompt = list(range(5, 5 + AUTO_PARALLEL_TOKENS_FLOAT32))
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        pool = resolve_threads("auto")
        no_amx_bf16 = dtype == "bfloat16" and "amx_bf16" not in host.cpu_flags()
        takes_pool = dtype == "float32" or no_amx_bf16
        assert seen == [(len(prompt), pool if takes_pool else 1), (1, pool if no_amx_bf16 else 1)]
    finally:
        torch.set_num_threads(saved)


def _run_python(code: str, **extra: str) -> list[str]:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    return subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                          check=True).stdout.split()


def test_import_asks_openmp_to_spin_briefly_when_idle():
    code = "import os, corerun, torch; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    assert _run_python(code) == ["None", str(host.SPIN_COUNT)]
    assert _run_python(code, GOMP_SPINCOUNT="1000") == ["None", "1000"]  # the user's own choice stays
    assert _run_python(code, OMP_WAIT_POLICY="PASSIVE") == ["PASSIVE", "None"]
    assert _run_python("import os, torch, corerun; print(os.environ.get('GOMP_SPINCOUNT'))") == ["None"]  # too late: left alone


RELEASE_CHECK = """
import os, corerun, torch
from corerun.platform import host
tasks = lambda: len(os.listdir("/proc/self/task"))
torch.set_num_threads(2)
x = torch.randn(1 << 20)
torch.add(x, 1)  # a parallel region on this thread: its OpenMP pool (one more thread), or the one it has
a = tasks()
{release}
b = tasks()
torch.add(x, 1)
print(a - b, tasks() - b)
"""


def test_the_engine_frees_its_constructing_threads_openmp_pool(tmp_path):
    """release_openmp_threads ends the calling thread's idle OpenMP threads (a later region makes them again), and
    building an engine on a CPU calls it (the runner's construction, last): the steps' thread then holds the only pool (GNU OpenMP spins less when it
    manages more threads than there are processors)."""
    if not host.openmp_runtimes() or resolve_threads("auto") < 2:
        pytest.skip("needs an OpenMP runtime and two cores")
    # a pool made on this thread, then freed: its thread ends, and the next region starts it again
    assert _run_python(RELEASE_CHECK.format(release="host.release_openmp_threads()")) == ["1", "1"]
    # not freed: the pool stays and the next region adds no thread
    assert _run_python(RELEASE_CHECK.format(release="pass")) == ["0", "0"]
    # building an engine frees it: the first region on this thread after the build starts a pool again
    build = ("x = torch.randn(1 << 20)\ntorch.add(x, 1)\nfrom corerun import LLM\n"
             f"llm = LLM(model={str(make_tiny_model(tmp_path))!r}, device='cpu', dtype='float32', attention='torch', "
             "threads=2, kv_cache={'num_blocks': 8})\ntorch.set_num_threads(2)\nn = len(os.listdir('/proc/self/task'))\n"
             "torch.add(x, 1)\nprint(len(os.listdir('/proc/self/task')) - n)")
    assert _run_python("import os, corerun, torch\n" + build) == ["1"]


def test_openmp_runtimes_from_maps():
    from corerun.platform.host import openmp_runtimes

    line = "7f0000000000-7f0000001000 r-xp 00000000 08:01 1234                       {}\n"
    maps = "".join(line.format(p) for p in (
        "/venv/torch/lib/libgomp.so.1", "/venv/torch/lib/libgomp.so.1", "/usr/lib/libstdc++.so.6",
        "/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0", "/opt/intel/libiomp5.so", "/home/libgompish.txt",
    )) + "7f0000002000-7f0000003000 rw-p 00000000 00:00 0 \n"
    assert openmp_runtimes(maps) == ["/opt/intel/libiomp5.so", "/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0",
                                     "/venv/torch/lib/libgomp.so.1"]
    assert openmp_runtimes("") == []


def test_threads_config_key():
    assert load_config().threads == "auto"
    assert load_config(sets=["threads=3"]).threads == 3
    with pytest.raises(ConfigError, match="threads must be >= 1 or 'auto'"):
        load_config(sets=["threads=0"])


def test_engine_applies_threads(tmp_path):
    from corerun.llm import LLM

    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        llm = LLM(model=str(make_tiny_model(tmp_path)), device="cpu", dtype="float32", attention="torch", threads=1,
                  kv_cache={"num_blocks": 8})
        assert torch.get_num_threads() == 1 and llm.engine.runner.threads == 1
    finally:
        torch.set_num_threads(saved)


def test_cpu_flags():
    from corerun.platform.host import BF16_FLAGS, cpu_flags

    text = _cpuinfo([(0, 0, 0)]).replace("flags\t\t: avx2", "flags\t\t: fpu avx2 avx512f avx512_bf16")
    assert cpu_flags(text) == {"fpu", "avx2", "avx512f", "avx512_bf16"} and BF16_FLAGS & cpu_flags(text)
    assert not BF16_FLAGS & cpu_flags(_cpuinfo([(0, 0, 0)])) and cpu_flags("processor : 0\n") == frozenset()


@pytest.mark.parametrize(("vendor", "mkl_rows"), [("GenuineIntel", MATMUL_MIN_ROWS), ("AuthenticAMD", None), ("", None)])
def test_many_row_float32_products_go_to_mkl_on_intel_only(monkeypatch, vendor, mkl_rows):
    """MKL's GEMM beat oneDNN's pack from 384 rows on a Sapphire Rapids and lost at every size on an EPYC."""
    from corerun.models import layers

    assert cpu_vendor("processor : 0\nvendor_id : AuthenticAMD\n") == "AuthenticAMD" and cpu_vendor("") == ""
    monkeypatch.setattr(host, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    layers._matmul_min_rows.cache_clear()
    try:
        assert layers._matmul_min_rows() == (mkl_rows if mkl_rows is not None else float("inf"))
    finally:
        monkeypatch.undo()
        layers._matmul_min_rows.cache_clear()


@needs_mkldnn
@pytest.mark.parametrize("tied", [False, True])
def test_loaded_float32_weights_are_column_major_and_both_paths_match_float64(tmp_path, monkeypatch, tied):
    from corerun.models.layers import use_cpu_matvec_layout
    from corerun.models.loader import load_model

    model, _ = load_model(make_tiny_model(tmp_path, tie_word_embeddings=tied), dtype="float32", device="cpu")
    linears = [m for m in model.modules() if isinstance(m, (Linear, LMHead))]
    assert linears and all(m.weight.stride() == (1, m.weight.shape[0]) for m in linears)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert use_cpu_matvec_layout(model) == 0  # already moved: nothing twice
    # every linear layer packed at load, of the weight as it is multiplied; the head packs on first use
    packs = {m: m.packed.packed for m in linears if isinstance(m, Linear)}
    assert all(p is not None for p in packs.values()) and model.lm_head.packed.packed is None
    layer = model.model.layers[0].mlp.down_proj
    g = torch.Generator().manual_seed(3)
    for rows in (1, 5, MATMUL_MIN_ROWS):  # 1 and MATMUL_MIN_ROWS: F.linear on the column-major weight; 5: the pack
        x = torch.randn(rows, layer.in_features, generator=g)
        with torch.inference_mode():
            y = layer(x)
        assert _rel(y, x.double() @ layer.weight.double().T) < 1e-6
        assert layer.packed.packed is packs[layer]  # the load's pack served the product: nothing packed again
    calls = []  # which product each row count takes: the pack from 2 rows up to MATMUL_MIN_ROWS - 1
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.inference_mode():
        for rows in (1, 2, MATMUL_MIN_ROWS - 1, MATMUL_MIN_ROWS, 2 * MATMUL_MIN_ROWS):
            layer(torch.randn(rows, layer.in_features, generator=g))
    large = [MATMUL_MIN_ROWS, 2 * MATMUL_MIN_ROWS]  # F.linear with MKL on Intel; elsewhere the pack
    mkl_wins = torch.backends.mkl.is_available() and cpu_vendor() == "GenuineIntel"
    assert calls == [2, MATMUL_MIN_ROWS - 1] + ([] if mkl_wins else large)
    with torch.inference_mode():  # the head's product of two rows packs it then
        logits = model.lm_head(torch.randn(2, layer.out_features, generator=g))
    assert model.lm_head.packed.packed is not None and logits.shape == (2, model.lm_head.weight.shape[0])
    ids = torch.tensor([3, 0, 7])  # the tied table is read column-major by the embedding too
    assert torch.equal(model.model.embed_tokens(ids), model.model.embed_tokens.weight.contiguous()[ids])


def test_prepacking_off_keeps_the_checkpoint_layout(tmp_path, monkeypatch):
    from corerun.models.loader import load_model

    monkeypatch.setenv("CORERUN_CPU_PREPACK", "0")
    model, _ = load_model(make_tiny_model(tmp_path), dtype="float32", device="cpu")
    assert all(m.weight.is_contiguous() for m in model.modules() if isinstance(m, (Linear, LMHead)))
    assert all(m.packed.packed is None for m in model.modules() if isinstance(m, (Linear, LMHead)))  # nothing packed
