"""The elementwise layers of the default model (SmolLM2-135M: hidden 576, intermediate 1536, 9 query and
3 KV heads of 64) as today's torch code (``RMSNorm.forward``, ``SiluAndMul.forward``, ``Rope.apply``)
against the ``cpu`` fused ops of corerun-attention-cpu, on one thread, interleaved call for call.

RMSNorm takes the hidden states [T, 576]; SiLU-and-mul a gate_up output [T, 2 * 1536]; RoPE the q and
the k heads viewed in a fused qkv output [T, (9 + 3 + 3) * 64].  Each line prints the time of a
call in ms, the fastest of ``--samples`` samples (each a loop of calls lasting at least ``--sample-ms``;
on a shared machine the fastest is the one least disturbed) for torch and for the kernel, taken
alternately, and their ratio torch / kernel (above 1: the kernel is faster).

    .venv/bin/python benchmarks/fused_ops_bench.py
    .venv/bin/python benchmarks/fused_ops_bench.py --tokens 1 512 --dtype bfloat16

``--baseline FILE`` adds a third contestant: the same wrapper calling kernels built from another
``fused_ops.cpp`` (an earlier revision, ``git show REV:PATH > FILE``) alone, with the plugin's compiler and
flags, timed in turn with the other two; its column ``baseline / fused`` is above 1 where the kernels of
this tree are faster.

    git show 6212449:plugins/attention_cpu/corerun_attention_cpu/csrc/fused_ops.cpp > /tmp/fused_ops_before.cpp
    .venv/bin/python benchmarks/fused_ops_bench.py --tokens 1 1024 --baseline /tmp/fused_ops_before.cpp

``--steps`` times whole steps of the default model instead (``attention: cpu``): two engines in this
process, ``fused_ops: torch`` and ``fused_ops: cpu``, taking turns at a prefill of ``--tokens``' first
length (fresh ids, one output token) and at 32 decode steps of ``--batch`` requests (prompts of 128),
``--samples`` turns each (a third engine with ``--baseline``'s kernels); it prints the fastest and the
median of each.

    .venv/bin/python benchmarks/fused_ops_bench.py --steps --dtype bfloat16 --tokens 512 --batch 4 --samples 6
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable
from unittest import mock

import corerun  # noqa: F401  (before torch: its OpenMP settings, corerun.platform.host)
import torch

from corerun.models.layers import RMSNorm, SiluAndMul
from corerun.models.rotary import Rope
from corerun_attention_cpu import kernels
from corerun_attention_cpu.fused_ops import CpuFusedOps

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, EPS = 576, 1536, 9, 3, 64, 1e-5


def build_baseline(source: Path) -> ctypes.CDLL:
    """A library of the kernels in ``source`` (a ``fused_ops.cpp``) alone, built as the plugin builds its own."""
    compiler, why = kernels.find_compiler()
    if compiler is None:
        raise SystemExit(f"--baseline: {why}")
    target = Path(tempfile.mkdtemp(prefix="fused_ops_baseline-")) / "libbaseline.so"
    subprocess.run([compiler, *kernels.BASE_FLAGS, *kernels.openmp_flags(), str(source), "-o", str(target)], check=True)
    return ctypes.CDLL(str(target))


def with_kernels(ops: CpuFusedOps, lib: ctypes.CDLL) -> CpuFusedOps:
    """``ops`` calling ``lib``'s kernels (declared as the plugin's own are) instead of the plugin's."""
    for name in ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary"):
        mine, theirs = getattr(ops, "_" + name), getattr(lib, "corerun_cpu_" + name)
        theirs.restype, theirs.argtypes = mine.restype, mine.argtypes
        setattr(ops, "_" + name, theirs)
    return ops


def cases(ops: list[CpuFusedOps], tokens: int, dtype: torch.dtype, gen: torch.Generator) -> dict[str, list[Callable]]:
    """op name -> [torch call, then each ``ops``' call] on the same inputs."""
    hidden = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    norm = RMSNorm(HIDDEN, EPS).to(dtype)
    norm.weight.data.copy_(torch.randn(HIDDEN, generator=gen))
    gate_up = torch.randn(tokens, 2 * INTER, generator=gen).to(dtype)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    q = qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    theta = torch.rand(tokens, 1, HEAD_DIM // 2, generator=gen) * 100
    rope = Rope(torch.cat([theta.cos()] * 2, -1), torch.cat([-theta.sin(), theta.sin()], -1))
    silu = SiluAndMul()
    return {
        "rms_norm": [lambda: norm(hidden), *(lambda o=o: o.rms_norm(hidden, norm.weight, EPS) for o in ops)],
        "silu_and_mul": [lambda: silu(gate_up), *(lambda o=o: o.silu_and_mul(gate_up) for o in ops)],
        "rotary q": [lambda: rope.apply(q), *(lambda o=o: o.rotary(q, rope.cos, rope.sin) for o in ops)],
        "rotary k": [lambda: rope.apply(k), *(lambda o=o: o.rotary(k, rope.cos, rope.sin) for o in ops)],
    }


def sample(fn: Callable, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def measure(fns: list[Callable], samples: int, sample_ms: float) -> list[float]:
    """The fastest sample's ms per call of each, the samples taken in turn."""
    for fn in fns:
        fn()
    calls = max(1, int(sample_ms / max(*(sample(fn, 3) for fn in fns), 1e-4)))
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(samples):
        for fn, own in zip(fns, times):
            own.append(sample(fn, calls))
    return [min(own) for own in times]


def steps(dtype: str, prefill: int, batch: int, samples: int, baseline: ctypes.CDLL | None) -> None:
    """Prefill and decode step times of the default model with each fused_ops, engines taking turns."""
    import random

    from corerun import LLM, SamplingParams

    def llm(fused_ops: str) -> LLM:
        return LLM(device="cpu", dtype=dtype, attention="cpu", threads=1, fused_ops=fused_ops, graph={"runner": {"name": "eager"}})  # the ops as called eagerly

    llms = {name: llm(name) for name in ("torch", "cpu")}
    if baseline is not None:  # the plugin's class, its instances built with the baseline's kernels
        init = CpuFusedOps.__init__
        with mock.patch.object(CpuFusedOps, "__init__", lambda self: (init(self), with_kernels(self, baseline))[0]):
            llms["base"] = llm("cpu")
    rng = random.Random(0)

    def run(llm: LLM, prompts: int, length: int, tokens: int) -> float:
        engine = llm.engine
        for _ in range(prompts):
            engine.add_request([rng.randrange(10000) for _ in range(length)], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        if tokens > 1:
            engine.step()  # the prefill, not timed
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return (time.perf_counter() - start) * 1e3 / max(1, tokens - 1)

    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in llms}
    for turn in range(samples + 1):  # the first turn warms up
        for name, llm in llms.items():
            pre, dec = run(llm, 1, prefill, 1), run(llm, batch, 128, 33)
            if turn:
                times[name][0].append(pre)
                times[name][1].append(dec)
    print(f"{dtype}, attention cpu, 1 thread: prefill of {prefill} tokens; decode step of {batch} request(s); "
          f"fastest (median) of {samples}, ms")
    for name, (pre, dec) in times.items():
        print(f"  fused_ops {name:5}{' (--baseline)' if name == 'base' else ''}: prefill {min(pre):8.1f} ({statistics.median(pre):.1f})   "
              f"decode step {min(dec):6.2f} ({statistics.median(dec):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512, 4096])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--sample-ms", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", action="store_true", help="time whole steps of the default model instead")
    parser.add_argument("--batch", type=int, default=1, help="--steps: requests decoding together")
    parser.add_argument("--baseline", type=Path, help="a fused_ops.cpp whose kernels are timed in turn with this tree's")
    args = parser.parse_args()
    baseline = build_baseline(args.baseline) if args.baseline else None
    if args.steps:
        for name in args.dtype:
            steps(name, args.tokens[0], args.batch, args.samples, baseline)
        return
    torch.set_num_threads(args.threads)
    ops, gen = [CpuFusedOps()], torch.Generator().manual_seed(0)
    head, cols = "| dtype | T | op | torch (ms) | cpu fused (ms) |", "| --- | ---: | --- | ---: | ---: |"
    if baseline is not None:
        ops.append(with_kernels(CpuFusedOps(), baseline))
        head, cols = head + " baseline (ms) | baseline / fused |", cols + " ---: | ---: |"
    print(f"threads {torch.get_num_threads()}, the fastest of {args.samples} samples of >= {args.sample_ms} ms, ms per call")
    print(f"{head} torch / fused |\n{cols} ---: |")
    for name in args.dtype:
        dtype = getattr(torch, name)
        for tokens in args.tokens:
            for op, calls in cases(ops, tokens, dtype, gen).items():
                t_ref, t_fused, *t_base = measure(calls, args.samples, args.sample_ms)
                base = "".join(f" {t:.4f} | {t / t_fused:.2f} |" for t in t_base)
                print(f"| {name} | {tokens} | {op} | {t_ref:.4f} | {t_fused:.4f} |{base} {t_ref / t_fused:.2f} |", flush=True)


if __name__ == "__main__":
    main()
