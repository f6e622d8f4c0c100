"""Paged attention on CPU: the ``torch`` reference backend (gather + einsum) against ``cpu`` (the
C++ kernel of corerun-attention-cpu reading the cache in place), on the same batch, in one run.

Shapes are the default model's (SmolLM2-135M: 9 query / 3 KV heads of size 64, block size 16,
float32 unless ``--dtype``).  Each case times one layer's ``forward`` (K/V write + attention), the
median of ``--reps`` calls after warm-up, at one and at two torch threads, and prints the ratio
torch / cpu measured side by side; it also prints the largest difference between the two outputs.

    .venv/bin/python benchmarks/cpu_attention_bench.py            # all cases, 1 and 2 threads
    .venv/bin/python benchmarks/cpu_attention_bench.py --threads 1 --dtype bfloat16
    .venv/bin/python benchmarks/cpu_attention_bench.py --threads 1 --cpu-time     # on a busy machine
    .venv/bin/python benchmarks/cpu_attention_bench.py --threads 1 --layers 30 -k "~160"  # a step's 30 layers
    .venv/bin/python benchmarks/cpu_attention_bench.py --threads 1 --parts -k prefill  # where cpu's time goes
    .venv/bin/python benchmarks/cpu_attention_bench.py --threads 1 --dtype bfloat16 --layers 30 -k "decode 128" --pages both

With ``--parts`` each case also splits the ``cpu`` backend's forward into the K/V write, the C++ kernel over
every request, and torch's SDPA over every request as one prompt (the backend's fresh-prompt route: with and
without its copies into the output), whichever route ``plan`` takes for each; in bfloat16 on a CPU with AMX
also the AMX prefill call over every request (when all are fresh prompts) and the whole forward planned
with and without the AMX route (the latter: today's route before it, SDPA from 128 tokens).

With ``--layers N`` each timed call runs N layers, each over its own copy of the cache, as a model
step does: the K/V then come from memory instead of the caches the previous call left warm.

With ``--pages both`` each case also times the ``cpu`` backend over a second set of cache copies allocated as the
engine allocates them (``zeros_kv_cache``: transparent huge pages where Linux allows them), against the first set
on ordinary 4 KiB pages (``torch.randn`` / ``clone``), the two taken alternately; the blocks of every request are
in random order, as in a long-running engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import corerun  # noqa: F401  (before torch: its OpenMP settings, corerun.platform.host)
import torch

from corerun.attention.torch_backend import TorchAttentionBackend
from corerun.protocols.attention import DTYPE_NAMES, AttentionBatch, AttentionSpec
from corerun.sdk.attention import zeros_kv_cache
from corerun_attention_cpu.backend import CpuAttentionBackend

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 9, 3, 64, 16


def cases(gen: torch.Generator) -> dict[str, list[tuple[int, int]]]:
    """name -> [(cached context, new tokens)] per request, decodes first."""
    def around(n: int, rows: int) -> list[int]:
        return torch.randint(n - n // 4, n + n // 4 + 1, (rows,), generator=gen).tolist()

    return {
        "decode 32 rows x ~160 keys": [(c, 1) for c in around(160, 32)],  # step_profile's decode step
        "decode 32 rows x ~500 keys": [(c, 1) for c in around(500, 32)],
        "decode 128 rows x ~768 keys": [(c, 1) for c in around(768, 128)],
        "decode 1 row x 1000 keys": [(1000, 1)],
        "prefill 1 x 512 new": [(0, 512)],
        "prefill 8 x 32-256 new": [(0, n) for n in torch.randint(32, 257, (8,), generator=gen).tolist()],
        "prefill 24 x 32-256 new": [(0, n) for n in torch.randint(32, 257, (24,), generator=gen).tolist()],  # step_profile's
        "prefill 1 x 2048 new": [(0, 2048)],
        "prefill 1 x 1024 new": [(0, 1024)],  # a 2,048-token float32 prompt's two chunks (budget 1024)
        "prefill 1 x 1024 new after 1024 cached": [(1024, 1024)],
        "prefill 4 x 128 new after 256 cached": [(256, 128)] * 4,
        "mixed 31 decodes ~300 keys + 256-token chunk": [(c, 1) for c in around(300, 31)] + [(128, 256)],
    }


def build(requests: list[tuple[int, int]], dtype: torch.dtype, gen: torch.Generator):
    bs = BLOCK
    seq = [c + q for c, q in requests]
    nblocks = [(s + bs - 1) // bs for s in seq]
    total = sum(nblocks) + 4
    perm = torch.randperm(total, generator=gen)
    width = max(nblocks)
    tables = torch.zeros(len(requests), width, dtype=torch.int32)
    at = 0
    for i, n in enumerate(nblocks):
        tables[i, :n] = perm[at : at + n].to(torch.int32)
        at += n
    qlens = [q for _, q in requests]
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    slots = []
    for i, (c, q) in enumerate(requests):
        for pos in range(c, c + q):
            slots.append(int(tables[i, pos // bs]) * bs + pos % bs)
    num_tokens = sum(qlens)
    nd = 0  # decodes come first: the leading requests with one query token
    while nd < len(qlens) and qlens[nd] == 1:
        nd += 1
    batch = AttentionBatch(
        query_start_loc=qsl, seq_lens=torch.tensor(seq, dtype=torch.int32),
        context_lens=torch.tensor([c for c, _ in requests], dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), num_reqs=len(requests), num_tokens=num_tokens,
        max_query_len=max(qlens), max_seq_len=max(seq), num_decodes=nd,
        query_start_loc_cpu=qsl, seq_lens_cpu=torch.tensor(seq, dtype=torch.int32),
    )
    q = torch.randn(num_tokens, HEADS, HEAD_SIZE, generator=gen).to(dtype)
    k = torch.randn(num_tokens, KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    v = torch.randn(num_tokens, KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    kv = torch.randn(2, total, bs, KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    return batch, q, k, v, kv


def timed(fn, reps: int, clock=time.perf_counter) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("-k", default="", help="only cases whose name contains this")
    ap.add_argument("--layers", type=int, default=1, help="layers per timed call, each with its own cache copy")
    ap.add_argument("--parts", action="store_true", help="also time the cpu backend's parts (module docstring)")
    ap.add_argument("--pages", choices=["4k", "both"], default="4k",
                    help="both: also time the cpu backend over caches on huge pages (module docstring)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time with the process's CPU time instead of the wall clock: steadier on a busy machine "
                         "at one thread (time spent descheduled is not counted); at two threads it adds both threads' time")
    args = ap.parse_args()
    dtype = DTYPE_NAMES[args.dtype]
    spec = AttentionSpec(HEADS, KV_HEADS, HEAD_SIZE, dtype, BLOCK, torch.device("cpu"))
    ref, cpu = TorchAttentionBackend(spec), CpuAttentionBackend(spec)
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {args.dtype}, {HEADS}/{KV_HEADS} heads x {HEAD_SIZE}, block {BLOCK}; "
          f"{args.layers} layer(s)' forward (K/V write + attention), median of {args.reps}, "
          f"{'process CPU time' if args.cpu_time else 'wall clock'}; load average {os.getloadavg()[0]:.2f}")
    clock = time.process_time if args.cpu_time else time.perf_counter
    print(f"{'case':48} {'threads':>7} {'torch ms':>10} {'cpu ms':>9} {'torch/cpu':>9} {'max |diff|':>10}")
    for name, requests in cases(gen).items():
        if args.k not in name:
            continue
        batch, q, k, v, kv = build(requests, dtype, gen)
        kv_torch = torch.cat([kv, torch.zeros_like(kv[:, :1])], dim=1)  # the torch backend's extra write-off block
        caches = [(kv, kv_torch)] + [(kv.clone(), kv_torch.clone()) for _ in range(args.layers - 1)]
        md_ref, md_cpu = ref.plan(batch), cpu.plan(batch)
        out_ref, out_cpu = torch.empty_like(q), torch.empty_like(q)

        def run_ref() -> None:
            for _, c in caches:
                ref.forward(q, k, v, c, md_ref, out=out_ref)

        def run_cpu() -> None:
            for c, _ in caches:
                cpu.forward(q, k, v, c, md_cpu, out=out_cpu)

        for n in args.threads:
            torch.set_num_threads(n)
            t_ref = timed(run_ref, args.reps, clock)
            t_cpu = timed(run_cpu, args.reps, clock)
            diff = (out_ref.double() - out_cpu.double()).abs().max().item()
            print(f"{name:48} {n:>7} {t_ref:>10.3f} {t_cpu:>9.3f} {t_ref / t_cpu:>8.1f}x {diff:>10.2e}")
            if args.parts:
                print("    " + parts(cpu, md_cpu, q, k, v, kv, out_cpu, args.reps, clock, batch))
            if args.pages == "both":
                print("    " + pages(cpu, md_cpu, q, k, v, [c for c, _ in caches], out_cpu, args.reps, clock))


def pages(cpu: CpuAttentionBackend, md, q, k, v, small: list, out, reps: int, clock) -> str:
    """The cpu backend's forward over ``small`` (4 KiB pages) and over copies on huge pages, turn about."""
    huge = [zeros_kv_cache(tuple(c.shape), c.dtype).copy_(c) for c in small]
    times: dict[str, list[float]] = {"4 KiB": [], "huge": []}
    for turn in range(2 * reps + 4):
        name, caches = ("4 KiB", small) if turn % 2 == 0 else ("huge", huge)
        t0 = clock()
        for c in caches:
            cpu.forward(q, k, v, c, md, out=out)
        if turn >= 4:  # two warm-up turns each
            times[name].append((clock() - t0) * 1e3)
    a, b = statistics.median(times["4 KiB"]), statistics.median(times["huge"])
    return f"pages: 4 KiB {a:.3f} ms, huge {b:.3f} ms ({a / b:.2f}x)"


def parts(cpu: CpuAttentionBackend, md, q, k, v, kv, out, reps: int, clock, batch: AttentionBatch) -> str:
    """One layer of the cpu backend split by route (``--parts``), each part timed on its own."""
    cache = cpu._cache_args(kv)
    qsl = md.query_start_loc.tolist()
    prompts = tuple((qsl[i], qsl[i + 1]) for i in range(md.num_reqs))
    gqa = cpu.spec.num_heads != cpu.spec.num_kv_heads

    def sdpa_only() -> None:
        for s, e in prompts:
            torch.nn.functional.scaled_dot_product_attention(
                q[s:e].transpose(0, 1).unsqueeze(0), k[s:e].transpose(0, 1).unsqueeze(0),
                v[s:e].transpose(0, 1).unsqueeze(0), is_causal=True, scale=cpu.scale, enable_gqa=gqa)

    t = {
        "K/V write": timed(lambda: cpu._write(k, v, cache, md.slot_mapping), reps, clock),
        "kernel, every request": timed(lambda: cpu._attend_paged(q, cache, out, md, 0, md.batch_args), reps, clock),
        "SDPA + copies, every request": timed(lambda: cpu._attend_fresh(q, k, v, out, prompts), reps, clock),
        "SDPA alone": timed(sdpa_only, reps, clock),
    }
    if cpu.amx_prefill:
        if all(n == e - s for n, (s, e) in zip(md.seq_lens.tolist(), prompts)):
            ranges = torch.tensor(prompts, dtype=torch.int32).reshape(-1, 2)
            t["AMX call, every request"] = timed(lambda: cpu._attend_fresh_amx(q, k, v, out, ranges), reps, clock)
        try:
            t["forward, AMX route"] = timed(lambda: cpu.forward(q, k, v, kv, md, out=out), reps, clock)
            cpu.amx_prefill = False
            md_old = cpu.plan(batch)
            t["forward, route without AMX"] = timed(lambda: cpu.forward(q, k, v, kv, md_old, out=out), reps, clock)
        finally:
            cpu.amx_prefill = True
    runs = [f"{a}-{b - 1}" for a, b in md.kernel_runs] if md.fresh_prompts else ["all"]
    where = "AMX" if md.fresh_amx is not None else "SDPA"
    route = f"plan: {len(md.fresh_prompts)} prompt(s) to {where}, requests {', '.join(runs) or 'none'} to the kernel"
    return "; ".join(f"{name} {ms:.3f} ms" for name, ms in t.items()) + f"; {route}"


if __name__ == "__main__":
    main()
