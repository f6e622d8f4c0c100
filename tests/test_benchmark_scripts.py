"""Every script in benchmarks/ runs end to end at its smallest size, so that a change to the engine
cannot silently break a benchmark.

Each script runs in its own process, as a user runs it, with a few steps on tiny shapes; the checks
are on what it prints: the fields it promises, counts fixed by the arguments, and ratios that are
finite and positive.  No timing is asserted.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
# "1.23x" in a table cell
RATIO = re.compile(r"(-?[\d.]+|nan|inf)x\b")


def run_script(name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 110) -> str:
    """Run ``benchmarks/NAME`` with this interpreter from the repository root; its stdout (it must exit 0)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(BENCH / name), *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, f"{name} {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def positive_finite(value: float, what: str) -> None:
    assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, f"{what} = {value!r}; expected a finite positive number"


def table_ratios(text: str, expected: int, what: str) -> list[float]:
    """The ``NNx`` ratios in ``text``: exactly ``expected`` of them, each finite and positive."""
    found = [float(m) for m in RATIO.findall(text)]
    assert len(found) == expected, f"{what}: expected {expected} ratios, found {found} in:\n{text}"
    for r in found:
        positive_finite(r, f"{what} ratio")
    return found


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny random Llama with a 256-id tokenizer (and a chat template); 1024 positions, as
    spec_decode_bench's fixed 256-token prompts and its repetitive workload need."""
    from tests.helpers.tiny_models import make_tiny_model
    from tests.helpers.tiny_tokenizer import add_tiny_tokenizer

    return add_tiny_tokenizer(make_tiny_model(tmp_path_factory.mktemp("bench"), "llama", max_position_embeddings=1024))


# ------------------------------------------------------------------------------ step_prep_bench
@pytest.mark.timeout(120)
def test_step_prep_bench_smoke():
    out = run_script(
        "step_prep_bench.py", "--seqs", "4", "--long", "2x64", "--prefill-seqs", "2",
        "--context-len", "32", "--block-size", "16", "--steps", "3", "--warmup", "1", "--json",
    )
    doc = json.loads(out)
    assert doc["block_size"] == 16 and doc["device"] == "cpu"
    got = [(r["scenario"], r["num_seqs"], r["num_tokens"], r["context_len"], r["steps"]) for r in doc["results"]]
    # decode: one token per sequence; prefill: every prompt token in one step
    assert got == [("decode", 4, 4, 32, 3), ("long decode", 2, 2, 64, 3), ("prefill", 2, 64, 32, 3)]
    for r in doc["results"]:
        for key in ("schedule_us", "prepare_corerun_us", "prepare_baseline_us", "prepare_ratio", "prepare_mean_ratio",
                    "step_corerun_us", "step_baseline_us", "step_ratio"):
            positive_finite(r[key], f"{r['scenario']} {key}")
        assert r["prepare_ratio"] == pytest.approx(r["prepare_baseline_us"] / r["prepare_corerun_us"])


# ------------------------------------------------------------------------------ sampler_bench
@pytest.mark.timeout(120)
def test_sampler_bench_pipeline_and_penalties_smoke():
    out = run_script(
        "sampler_bench.py", "--vocab", "1000", "--batches", "1", "4", "--repeats", "1", "--threads", "1",
        "--penalty-batch", "4", "--prompt-len", "16", "--output-len", "8", "--steps", "2",
    )
    penalties, pipeline = out.split("penalties:", 1)[1].split("\n\n", 1)
    rows = {line[:16].strip(): line for line in penalties.splitlines()[2:] if line.strip()}  # names in 16 columns
    assert set(rows) == {"penalty stage", "greedy step", "sampled step"}, penalties
    for name, line in rows.items():
        table_ratios(line, 2, f"penalties {name}")  # lists / views, dense / views
    batches = [line.split()[0] for line in pipeline.splitlines()[1:] if line.strip()]
    assert batches == ["1", "4"], pipeline
    table_ratios(pipeline, 2, "pipeline")


@pytest.mark.timeout(120)
def test_sampler_bench_grammar_smoke():
    pytest.importorskip("xgrammar")
    pytest.importorskip("corerun_structured_output")
    out = run_script("sampler_bench.py", "--cases", "grammar", "--grammar-batches", "1", "--repeats", "1", "--threads", "1")
    table = out.split("grammar:", 1)[1]
    states = [line[:16].strip() for line in table.splitlines()[2:] if line.strip()]
    assert states == ["inside a string", "after a key"], table
    table_ratios(table, 2, "grammar overhead")


# ------------------------------------------------------------------------------ async_step_profile
@pytest.mark.timeout(120)
def test_async_step_profile_smoke(tiny_llama):
    out = run_script("async_step_profile.py", "--model", str(tiny_llama), "--attention", "torch", "--num-seqs", "2",
                     "--prompt-len", "6", "--max-tokens", "4", "--rounds", "2")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["sync"], ["async"])]
    # interleaved: round 1 sync then async, round 2 async then sync
    assert [(r[0], r[1]) for r in rows] == [("sync", "1"), ("async", "1"), ("async", "2"), ("sync", "2")], out
    for mode, _, elapsed, steps, *ms, share, gap in rows:
        assert int(steps) == 4, f"{mode}: both prompts fit one prefill step, then one token per step: 4 steps for 4 tokens"
        for v in (elapsed, *ms):
            positive_finite(float(v), f"{mode} column")
        assert 0 < float(share.rstrip("%")) < 100, f"{mode} host share {share}"
        if mode == "async":
            positive_finite(float(gap), "async idle gap")
        else:
            assert gap == "-"


# ------------------------------------------------------------------------------ step_profile
@pytest.mark.timeout(120)
def test_step_profile_smoke(tiny_llama):
    out = run_script("step_profile.py", "--model", str(tiny_llama), "--attention", "torch", "--context", "8",
                     "--prefill", "16", "--repeat", "2")
    parts = ("linears", "attention", "norms / elementwise / other ops", "sampling", "host")
    for step in ("one decode step (1 request, context 8)", "one prefill step (16 tokens)"):
        block = out.split(step, 1)[1].split("\n\n", 1)[0]
        shares = {p: float(re.search(re.escape(p) + r"\s+(-?[\d.]+) ms\s+(-?[\d.]+) %", block).group(2)) for p in parts}
        assert shares["linears"] > 0 and shares["attention"] > 0, block
        assert sum(shares.values()) == pytest.approx(100, abs=0.5), block  # the parts split the whole step
    # several prompts in one prefill step
    out = run_script("step_profile.py", "--model", str(tiny_llama), "--attention", "torch", "--context", "8",
                     "--prefill", "8:24", "--prefill-prompts", "3", "--repeat", "2")
    block = out.split("one prefill step (3 prompts of 8:24 tokens)", 1)[1].split("\n\n", 1)[0]
    assert float(re.search(r"linears\s+(-?[\d.]+) ms", block).group(1)) > 0, block


def test_one_request_anatomy_smoke(tiny_llama):
    out = run_script("one_request_anatomy.py", "--model", str(tiny_llama), "--dtype", "float32", "--tokens", "6",
                     "--repeats", "2")
    layers = json.loads((tiny_llama / "config.json").read_text())["num_hidden_layers"]
    calls = re.search(r"linear layers inside the model:\s+([\d.]+) ms per token \((\d+) calls", out)
    assert calls and int(calls.group(2)) == 4 * layers + 1, out  # qkv, o, gate_up, down per layer, then the head
    for name in ("step as it runs", "the same calls back to back", "the rest, inside the model", "the rest, linear layers filled instead"):
        positive_finite(float(re.search(re.escape(name) + r":\s+(-?[\d.]+) ms", out).group(1)), name)


# ------------------------------------------------------------------------------ serve_bench
@pytest.mark.timeout(120)
def test_serve_bench_self_smoke(tiny_llama):
    out = run_script("serve_bench.py", "--self", "--model", str(tiny_llama), "--set", "attention=torch",
                     "--num-prompts", "2", "--input-len", "4:8", "--output-len", "2:4", "--rounds", "1")
    assert re.search(r"^completed 2\s+failed 0\b", out, re.M), out
    for field in ("TTFT (ms)", "TPOT (ms)", "ITL (ms)", "E2E (ms)", "output throughput"):
        assert field in out, f"{field!r} missing from:\n{out}"
    last = out.strip().splitlines()[-1]
    assert last.startswith("best of 1: LLM.generate"), out
    table_ratios(last, 2, "HTTP / generate, HTTP / stream")


# ------------------------------------------------------------------------------ spec_decode_bench
@pytest.mark.timeout(120)
def test_spec_decode_bench_smoke(tiny_llama):
    out = run_script("spec_decode_bench.py", "--max-tokens", "4", "--rounds", "1", "--",
                     "--model", str(tiny_llama), "--attention", "torch", "--threads", "1")
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith(("| workload", "| ---"))]
    names = [r.split("|")[1].strip() for r in rows]
    assert names == ["repetitive, greedy", "random tokens, greedy", "random tokens, T=1 seeded"], out
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        positive_finite(float(cells[1]), f"{cells[0]} off tok/s")
        positive_finite(float(cells[2]), f"{cells[0]} on tok/s")
        table_ratios(cells[3], 1, f"{cells[0]} on / off")
        assert int(cells[5]) <= int(cells[4]), f"{cells[0]}: more drafts accepted than proposed"
        # greedy, or seeded sampling: speculation must not change the tokens
        assert cells[7] == "True", f"{cells[0]}: outputs with speculation on differ from off"


# ------------------------------------------------------------------------------ dtype_greedy_check
@pytest.mark.timeout(120)
def test_dtype_greedy_check_smoke(tiny_llama):
    out = run_script("dtype_greedy_check.py", "--model", str(tiny_llama), "--dtypes", "float32", "--tokens", "3",
                     "--random", "2", "--attention", "torch", "--threads", "1")
    m = re.search(r"^float32: (\d+)/(\d+) requests equal to transformers", out, re.M)
    assert m, out
    # 8 chat texts and 2 random prompts; in float32 corerun's greedy tokens are transformers' (the
    # model conformance suite holds the logits to float64 references)
    assert (int(m[1]), int(m[2])) == (10, 10), out


# ------------------------------------------------------------------------------ CPU kernels
@pytest.mark.timeout(120)
def test_cpu_attention_bench_smoke():
    pytest.importorskip("corerun_attention_cpu")
    out = run_script("cpu_attention_bench.py", "--threads", "1", "--reps", "1", "-k", "1 row")
    rows = [line for line in out.splitlines() if line.startswith("decode 1 row")]
    assert len(rows) == 1, out
    table_ratios(rows[0], 1, "torch / cpu")
    diff = float(rows[0].split()[-1])
    assert diff < 1e-4, f"the cpu kernel's output differs from the torch reference by {diff}"


def test_cpu_attention_bench_pages_both_prints_both_timings():
    pytest.importorskip("corerun_attention_cpu")
    out = run_script("cpu_attention_bench.py", "--threads", "1", "--reps", "1", "-k", "1 row", "--pages", "both")
    line = next((x for x in out.splitlines() if x.strip().startswith("pages:")), None)
    assert line is not None, out
    small, huge = (float(x) for x in re.findall(r"(?:4 KiB|huge) ([0-9.]+) ms", line))
    assert small > 0 and huge > 0, line


@pytest.mark.timeout(120)
def test_linear_bench_smoke():
    out = run_script("linear_bench.py", "--threads", "1", "--tokens", "1", "--repeats", "1")
    rows = [line for line in out.splitlines() if line.startswith("T=")]
    assert [r.split(":")[0] for r in rows] == ["T=1"], out
    for row in rows:
        for name in ("float32 plain", "float32 prepacked", "float32 column-major", "bfloat16 plain", "bfloat16 prepacked"):
            assert name in row, f"{name!r} missing from {row!r}"
        ratios = table_ratios(row.split("; load")[0], 5, row.split(":")[0])
        assert ratios[0] == 1.0  # float32 plain against itself


@pytest.mark.timeout(120)
def test_int8_linear_bench_smoke():
    out = run_script("int8_linear_bench.py", "--threads", "1", "--tokens", "1", "--repeats", "1")
    rows = [line for line in out.splitlines() if line.startswith("T=")]
    assert [r.split(":")[0] for r in rows] == ["T=1"], out
    ways = ["float32", "float32 prepacked", "w8a8 float codes"]
    ways += [{"int_mm": "w8a8 _int_mm", "onednn": "w8a8 oneDNN"}[p] for p in ("int_mm", "onednn") if p in out.splitlines()[0]]
    for name in ways:
        assert f"{name} " in rows[0], f"{name!r} missing from {rows[0]!r}"
    ratios = table_ratios(rows[0].split("; load")[0], len(ways), "T=1")
    assert ratios[1] == 1.0  # float32 prepacked against itself


@pytest.mark.timeout(150)
def test_int8_amx_bench_smoke():
    kernels = pytest.importorskip("corerun_quant_cpu.kernels")
    if kernels.load() or not (kernels.int8_amx_available() or kernels.int8_vnni_available()):
        pytest.skip("no corerun-quant-cpu kernel library, or neither AMX-INT8 nor AVX-512 VNNI here")
    out = run_script("int8_amx_bench.py", "--tokens", "2", timeout=140)
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("2 ")]
    assert len(rows) == 1, out
    # T, the call (AMX or VNNI), few-token loop (AMX; "-" on VNNI), built-in, ratio, TOPS
    amx, builtin, ratio = float(rows[0][1]), float(rows[0][3]), float(rows[0][4].rstrip("x"))
    assert ("AMX call" in out) == kernels.int8_amx_available()
    if kernels.int8_amx_available():
        positive_finite(float(rows[0][2]), "few-token loop ms")
    else:
        assert rows[0][2] == "-"
    for value, what in ((amx, "call ms"), (builtin, "built-in ms"), (ratio, "ratio")):
        positive_finite(value, what)
    assert abs(ratio - builtin / amx) <= 0.01 * ratio + 0.01  # the printed ratio is the two times'


@pytest.mark.timeout(120)
def test_w4_prefill_bench_smoke():
    from corerun_quant_cpu import kernels

    if kernels.load() or not kernels.w4_available():
        pytest.skip("the 4-bit product does not run here")
    out = run_script("w4_prefill_bench.py", "--layers", "1", "--tokens", "1,17", "--repeats", "1")
    assert "4 products, 1 thread(s)" in out
    rows = [line for line in out.splitlines() if " tokens: " in line]
    assert [int(r.split()[0]) for r in rows] == [1, 17]
    for r in rows:
        times = dict(zip(r.split(":", 1)[1].split()[::2], r.split(":", 1)[1].split()[1::2]))
        assert set(times) == {"decode", "f32", "bf16", "kernel"}
        for path, ms in times.items():
            positive_finite(float(ms), f"{path} ms")
