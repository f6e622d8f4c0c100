"""Where one step's time goes: a decode step and a prefill step of the default model, part by part.

Runs the default model (float32 unless ``--dtype``) on ``--threads`` threads (1 by default) under
``torch.profiler`` and splits each step's wall time into:

- **linears**: the top-level matrix products (``aten::linear`` / ``addmm`` / ``mm`` / ``matmul``,
  oneDNN's prepacked ``mkldnn::_linear_pointwise`` and int8 ``onednn::qlinear_pointwise``, corerun-quant-cpu's
  C++ products) and the LM head (``ModelRunner._compute_logits``);
- **attention**: the attention backend's ``forward`` per layer (the KV write and the kernel; the
  ``cpu`` backend's C++ kernel is one ctypes call, invisible to the profiler, so the call is timed as a range);
- **norms / elementwise / other ops**: every other top-level torch operator (RMSNorm's pieces, RoPE,
  SiLU and the gate product, residual adds, the embedding, copies), with the largest named, and the
  calls of a ``fused_ops`` plugin (timed as ranges: a C++ kernel may be invisible to the profiler);
- **sampling**: ``ModelRunner._sample`` (the sampler and its bookkeeping);
- **host**: what is left: Python between the operators, torch's dispatch, the step's input
  preparation and the scheduler's share inside ``ModelRunner.execute``.

Each figure is the median over ``--repeat`` steps of the same kind (a decode at a context of
``--context`` tokens for ``--batch`` requests, one by default, counted only with the whole batch in the step; a prefill of ``--prefill`` prompt tokens); the profiler adds its
own cost to every operator (the un-profiled step time is printed beside it).

    .venv/bin/python benchmarks/step_profile.py [--model DIR] [--threads 1] [--attention cpu] [--fused-ops auto] [--context 128] [--batch 1] [--prefill 512 | 32:256 --prefill-prompts 28]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import defaultdict
from typing import Any

LINEAR_OPS = {"aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "mkldnn::_linear_pointwise", "aten::bmm",
              "corerun_quant_cpu::bf16_gemv", "corerun_quant_cpu::gguf_gemv", "corerun_quant_cpu::gguf_gemv_q8_0r",
              "corerun_quant_cpu::int8_amx_linear", "corerun_quant_cpu::f32_gemv", "corerun_quant_cpu::int8_vnni_linear",
              "onednn::qlinear_pointwise", "aten::_int_mm"}
PARTS = ("linears", "attention", "norms / elementwise / other ops", "sampling", "host")
RANGES = {"corerun.attention": "attention", "corerun.sampling": "sampling", "corerun.lm_head": "linears",
          "corerun.fused_ops": PARTS[2]}


def _wrap(obj: Any, name: str, label: str) -> None:
    import torch

    inner = getattr(obj, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(label):
            return inner(*args, **kwargs)

    setattr(obj, name, wrapped)


def split(step: Any) -> tuple[dict[str, float], dict[str, float]]:
    """One step's event: ms per part, and ms per operator name among the other ops."""
    parts: dict[str, float] = defaultdict(float)
    others: dict[str, float] = defaultdict(float)

    def walk(ev: Any) -> None:
        if ev.name in RANGES:
            parts[RANGES[ev.name]] += ev.cpu_time_total / 1e3
        elif ev.name in LINEAR_OPS:
            parts["linears"] += ev.cpu_time_total / 1e3
        elif "::" in ev.name:
            parts[PARTS[2]] += ev.cpu_time_total / 1e3
            others[ev.name] += ev.cpu_time_total / 1e3
        else:  # another range: look inside
            for child in ev.cpu_children:
                walk(child)

    for child in step.cpu_children:
        walk(child)
    parts["host"] = step.cpu_time_total / 1e3 - sum(parts.values())
    return dict(parts), dict(others)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a Hugging Face model folder [the default model]")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--attention", default="cpu")
    ap.add_argument("--fused-ops", default="auto", help="fused_ops: auto, torch or an installed plugin's name")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--context", type=int, default=128, help="the decoding requests' prompt length")
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together in the decode step")
    ap.add_argument("--prefill", default="512", help="the prefill step's prompt length, or LO:HI for prompts of lengths drawn "
                    "uniformly from LO..HI (with --prefill-prompts)")
    ap.add_argument("--prefill-prompts", type=int, default=1, help="prompts prefilled together in one step (as the first "
                    "step of a many-request workload: 28 prompts of 32:256 tokens fill the CPU's 4096-token budget)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--kv-cache-gb", type=float, default=6.0, help="the KV cache's CPU budget (kv_cache.cpu_memory_gb): "
                    "room for every request at once, so that no step is a recompute after a preemption")
    args = ap.parse_args()
    lo, _, hi = args.prefill.partition(":")
    prefill_range = (int(lo), int(hi or lo))

    from corerun import LLM, SamplingParams  # (before torch: its OpenMP settings, corerun.platform.host)

    import torch

    llm = LLM(model=args.model, device="cpu", dtype=args.dtype, attention=args.attention, fused_ops=args.fused_ops,
              threads=args.threads, kv_cache={"cpu_memory_gb": args.kv_cache_gb},
              graph={"runner": {"name": "eager"}})  # eager: the profile wraps Python calls a replayed step never makes
    runner = llm.engine.runner
    _wrap(runner.attention, "forward", "corerun.attention")
    for op in ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary") if runner.fused_ops is not None else ():
        if hasattr(runner.fused_ops, op):  # add_rms_norm is optional
            _wrap(runner.fused_ops, op, "corerun.fused_ops")
    _wrap(runner, "_sample", "corerun.sampling")
    _wrap(runner, "_compute_logits", "corerun.lm_head")
    inner_execute = runner.execute
    walls: dict[str, list[float]] = defaultdict(list)

    def execute(sched: Any, eos: Any) -> Any:
        # (the decoding requests' own prompts are prefilled too: those steps are not the prefill measured)
        # a decode step counts only with the whole batch in it (the requests prefilled first decode beside the
        # others' prefill; a step after some have finished is a smaller batch), and only the first --repeat of them
        decode = len(sched.num_scheduled) == args.batch and all(n == 1 for n in sched.num_scheduled) and decodes[0] < args.repeat
        decodes[0] += decode
        kind = "decode" if decode else "prefill" if phase[0] == "prefill" else "context"
        t0 = time.perf_counter()
        with torch.profiler.record_function(f"corerun.step.{kind}"):
            out = inner_execute(sched, eos)
        walls[kind].append((time.perf_counter() - t0) * 1e3)
        return out

    runner.execute = execute
    rng = random.Random(0)
    # enough tokens that the first request prefilled still decodes after the last one's prefill, then --repeat
    # whole-batch decodes (the requests already decoding take their tokens of each step's budget)
    prefill_steps = -(-args.batch * args.context // max(1, runner.max_num_batched_tokens - args.batch))
    greedy = SamplingParams(temperature=0, max_tokens=args.repeat + 1 + prefill_steps, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    engine = llm.engine
    vocab = min(runner.vocab_size, 10000)

    def serve(lengths: tuple[int, int], params: SamplingParams, count: int = 1) -> None:  # on this thread (the profiler records its own)
        for _ in range(count):
            length = rng.randint(*lengths)
            engine.add_request([rng.randrange(vocab) for _ in range(length)], params)  # fresh ids: no prefix-cache hits
        while engine.has_unfinished_requests():
            engine.step()

    phase = ["context"]
    decodes = [0]  # whole-batch decode steps seen in this pass

    def workload() -> None:
        phase[0] = "context"
        decodes[0] = 0
        serve((args.context, args.context), greedy, args.batch)
        phase[0] = "prefill"
        for _ in range(args.repeat):
            serve(prefill_range, one, args.prefill_prompts)

    workload()  # warm-up, and the un-profiled step times
    plain = {k: statistics.median(v) for k, v in walls.items()}
    load = os.getloadavg()[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        workload()
    steps: dict[str, list[tuple[dict[str, float], dict[str, float], float]]] = defaultdict(list)
    for ev in prof.events():
        if ev.name.startswith("corerun.step."):
            kind = ev.name.rsplit(".", 1)[1]
            steps[kind].append((*split(ev), ev.cpu_time_total / 1e3))
    print(f"{args.model or 'default model'}, {args.dtype}, attention {args.attention}, fused_ops {runner.fused_ops_name}, "
          f"{torch.get_num_threads()} thread(s), "
          f"load {load:.1f} -> {os.getloadavg()[0]:.1f}")
    if engine.scheduler.num_preemptions:
        print(f"{engine.scheduler.num_preemptions} preemption(s): some steps were recomputes; raise --kv-cache-gb")
    for kind, label in (("decode", f"one decode step ({args.batch} request{'s' if args.batch > 1 else ''}, context {args.context})"),
                        ("prefill", f"one prefill step ({args.prefill} tokens)" if args.prefill_prompts == 1
                         else f"one prefill step ({args.prefill_prompts} prompts of {args.prefill} tokens)")):
        runs = steps[kind]
        if not runs:
            print(f"\n{label}: no such step was seen (a decode step counts only with all {args.batch} requests in it)")
            continue
        total = statistics.median(r[2] for r in runs)
        print(f"\n{label}: {total:.2f} ms profiled, {plain[kind]:.2f} ms without the profiler (median of {len(runs)})")
        for part in PARTS:
            ms = statistics.median(r[0].get(part, 0.0) for r in runs)
            print(f"  {part:32s} {ms:8.2f} ms  {100 * ms / total:5.1f} %")
        names = {n for r in runs for n in r[1]}
        top = sorted(((statistics.median(r[1].get(n, 0.0) for r in runs), n) for n in names), reverse=True)[:8]
        print("  the other ops, largest: " + ", ".join(f"{n} {ms:.2f}" for ms, n in top))


if __name__ == "__main__":
    main()
