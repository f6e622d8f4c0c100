"""Triton paged attention on one GPU: decode bandwidth and prefill throughput, side by side with peers.

Decode: for each (batch size, context length), one decode token per request over a paged cache
with shuffled block tables.  Reports the K/V bytes the step must read divided by its time, and that
bandwidth as a fraction of the device's measured copy bandwidth, for

- ``triton``         the plugin with its split-KV rule (``num_splits="auto"``), eager launches;
- ``triton-graph``   the same step replayed from a CUDA graph (what the engine runs);
- ``triton-nosplit`` the unified kernel alone (``num_splits=1``);
- ``torch``          corerun's reference backend, on the smaller shapes.

Prefill: causal self-attention of fresh prompts (no cached prefix), the plugin against
``torch.nn.functional.scaled_dot_product_attention`` on the same shapes (contiguous Q/K/V, GQA
through ``enable_gqa``), plus one chunk over a long cached prefix (SDPA then needs an explicit mask).
Throughput is attention FLOPs (``4 * head_size * num_heads * causal pairs``) per second.  Backend
times are whole ``forward`` calls, so they include writing the step's K/V into the cache.

Every timed configuration is also checked against a float32 torch computation of the same step
(``rel_err``: max |out - ref| / max |ref|); the exit status is 1 when one goes above ``--max-error``.
Prints a table and writes JSON to ``--out`` (a file, or a folder that gets ``bench_attention.json``),
rewritten before and after every measurement: a run cut short keeps its rows and names the one it was in.

    python benchmarks/gpu/bench_attention.py --out results/bench_attention.json
    python benchmarks/gpu/bench_attention.py --out /tmp/b.json --smoke     # CPU, interpreter, tiny shapes

``--smoke`` only exercises this script (Triton's interpreter on CPU); its numbers mean nothing.
``--dry-run`` only writes the planned rows (no torch import): ``run.sh --dry-run`` rehearses with it.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # imported where used: a --dry-run never loads torch
    import torch

    from corerun.protocols.attention import AttentionSpec

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "plugins" / "attention_triton"):  # runs from a checkout without pip installs
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from benchmarks.gpu.part_report import PartReport  # noqa: E402

GIB = 1024**3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON file (or folder for bench_attention.json)")
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--decode-batches", default="1,8,32,128")
    p.add_argument("--decode-contexts", default="1024,8192,32768")
    p.add_argument("--prefill-lens", default="512,2048,8192")
    p.add_argument("--prefill-requests", type=int, default=4, help="equal-length prompts per prefill batch")
    p.add_argument("--prefix-len", type=int, default=8192, help="cached prefix of the chunked-prefill row")
    p.add_argument("--chunk-len", type=int, default=512, help="query tokens of the chunked-prefill row")
    p.add_argument("--max-kv-gib", type=float, default=16.0, help="skip decode shapes whose cache is larger")
    p.add_argument("--torch-max-kv-gib", type=float, default=1.0, help="run the torch reference up to this cache size")
    p.add_argument("--max-error", type=float, default=2e-2, help="largest rel_err accepted (exit status 1 above)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="CPU run with tiny shapes, to exercise the script")
    p.add_argument("--dry-run", action="store_true", help="write the planned rows only (no torch, no device)")
    args = p.parse_args(argv)
    if args.smoke:
        args.heads, args.kv_heads, args.head_size = 4, 2, 64
        args.decode_batches, args.decode_contexts, args.prefill_lens = "1,3", "40,100", "24"
        args.prefill_requests, args.prefix_len, args.chunk_len = 2, 40, 8
        args.warmup, args.iters = 1, 2
    args.decode_batch_list = [int(x) for x in args.decode_batches.split(",") if x.strip()]
    args.decode_context_list = [int(x) for x in args.decode_contexts.split(",") if x.strip()]
    args.prefill_len_list = [int(x) for x in args.prefill_lens.split(",") if x.strip()]
    return args


# ---------------------------------------------------------------------------------------------- timing
class Timer:
    """Median milliseconds of ``fn()``: CUDA events on a GPU (L2 flushed between calls), wall clock on CPU."""

    def __init__(self, device: torch.device, warmup: int, iters: int) -> None:
        import torch

        self.device, self.warmup, self.iters = device, warmup, iters
        self.flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=device) if device.type == "cuda" else None

    def __call__(self, fn: Callable[[], Any]) -> float:
        import torch

        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            times = []
            for _ in range(self.iters):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        for s, e in zip(starts, ends):
            self.flush.zero_()  # evict the cache from L2 so every run reads K/V from HBM
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copy_bandwidth(device: torch.device, timer: Timer, smoke: bool) -> float:
    """Device memory bandwidth in GB/s, measured as bytes read + written by a large copy."""
    import torch

    n = (64 if smoke else 4096) * 1024 * 1024
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------------------------------------- batches
def make_step(
    spec: AttentionSpec, reqs: list[tuple[int, int]], gen: torch.Generator, device: torch.device
) -> dict[str, Any]:
    """Random Q/K/V, a random paged cache (canonical layout) with shuffled blocks, and the batch."""
    import torch

    from corerun.protocols.attention import AttentionBatch

    bs = spec.block_size
    seq_lens = [c + q for c, q in reqs]
    blocks = [math.ceil(s / bs) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks)
    table = torch.zeros(len(reqs), width, dtype=torch.int32)
    for i, n in enumerate(blocks):
        table[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    k_canon = torch.randn(num_blocks, bs, spec.num_kv_heads, spec.head_size, device=device, dtype=spec.dtype)
    v_canon = torch.randn_like(k_canon)
    num_tokens = sum(q for _, q in reqs)
    query = torch.randn(num_tokens, spec.num_heads, spec.head_size, device=device, dtype=spec.dtype)
    key = torch.randn(num_tokens, spec.num_kv_heads, spec.head_size, device=device, dtype=spec.dtype)
    value = torch.randn_like(key)
    slots = [int(table[i, (c + j) // bs]) * bs + (c + j) % bs for i, (c, q) in enumerate(reqs) for j in range(q)]
    q_lens = [q for _, q in reqs]
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    num_decodes = 0
    while num_decodes < len(reqs) and reqs[num_decodes][1] == 1:
        num_decodes += 1
    batch = AttentionBatch(
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        context_lens=torch.tensor([c for c, _ in reqs], dtype=torch.int32, device=device),
        block_tables=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_reqs=len(reqs), num_tokens=num_tokens, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        num_decodes=num_decodes, query_start_loc_cpu=qsl, seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
    )
    return dict(reqs=reqs, batch=batch, query=query, key=key, value=value, k=k_canon, v=v_canon, num_blocks=num_blocks)


def load_cache(backend: Any, step: dict[str, Any]) -> torch.Tensor:
    cache = backend.allocate_kv_cache(step["num_blocks"])
    k, v = backend.kv_cache_view(cache)
    k.copy_(step["k"])
    v.copy_(step["v"])
    return cache


def gather_sequence(spec: AttentionSpec, step: dict[str, Any], i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``i``'s K and V ``[seq_len, Hkv, D]``: its prefix read through the block table, then its new tokens."""
    import torch

    b, bs = step["batch"], spec.block_size
    ctx, q_len = step["reqs"][i]
    start = int(b.query_start_loc_cpu[i])
    pos = torch.arange(ctx, device=step["k"].device)
    blocks = b.block_tables[i, pos // bs].long()
    k = torch.cat([step["k"][blocks, pos % bs], step["key"][start : start + q_len]])
    v = torch.cat([step["v"][blocks, pos % bs], step["value"][start : start + q_len]])
    return k, v


def reference(spec: AttentionSpec, step: dict[str, Any], max_reqs: int = 4) -> tuple[list[int], torch.Tensor]:
    """float32 attention of the first ``max_reqs`` requests: (their token rows, ``[rows, H, D]``)."""
    import torch

    group = spec.num_heads // spec.num_kv_heads
    rows, outs = [], []
    start = 0
    for i, (ctx, q_len) in enumerate(step["reqs"][:max_reqs]):
        k, v = gather_sequence(spec, step, i)
        k = k.float().repeat_interleave(group, 1).transpose(0, 1)  # [H, S, D]
        v = v.float().repeat_interleave(group, 1).transpose(0, 1)
        q = step["query"][start : start + q_len].float().transpose(0, 1)  # [H, L, D]
        pos = torch.arange(ctx + q_len, device=q.device)
        mask = pos[None, :] <= (ctx + torch.arange(q_len, device=q.device))[:, None]
        scores = (q @ k.transpose(1, 2)) * spec.softmax_scale
        out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v  # [H, L, D]
        rows.extend(range(start, start + q_len))
        outs.append(out.transpose(0, 1))
        start += q_len
    return rows, torch.cat(outs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


# ---------------------------------------------------------------------------------------------- backends
def make_backend(name: str, spec: AttentionSpec) -> Any:
    if name.startswith("triton"):
        from corerun_attention_triton.backend import TritonAttentionBackend

        return TritonAttentionBackend(spec, num_splits=1 if name == "triton-nosplit" else "auto")
    from corerun.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(spec)


def torch_backend_available() -> str | None:
    try:
        from corerun.attention.torch_backend import TorchAttentionBackend  # noqa: F401
    except Exception as exc:  # the reference backend is a peer, not a requirement
        return f"{type(exc).__name__}: {exc}"
    return None


def time_backend(name: str, spec: AttentionSpec, step: dict[str, Any], timer: Timer) -> tuple[float, torch.Tensor, Any]:
    """(ms per forward, the output, the plan) of one backend on ``step`` (eager launches)."""
    import torch

    backend = make_backend(name, spec)
    cache = load_cache(backend, step)
    plan = backend.plan(step["batch"])
    out = torch.empty_like(step["query"])

    def fn() -> None:
        backend.forward(step["query"], step["key"], step["value"], cache, plan, out=out)

    ms = timer(fn)
    return ms, out, plan


def time_graph(spec: AttentionSpec, step: dict[str, Any], timer: Timer) -> tuple[float, torch.Tensor]:
    """(ms per replay, output) of the triton decode step captured in a CUDA graph."""
    import torch

    backend = make_backend("triton", spec)
    cache = load_cache(backend, step)
    plan = backend.plan(step["batch"])
    out = torch.empty_like(step["query"])

    def fn() -> None:
        backend.forward(step["query"], step["key"], step["value"], cache, plan, out=out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = timer(graph.replay)
    return ms, out


# ---------------------------------------------------------------------------------------------- runs
def decode_label(batch_size: int, ctx: int) -> str:
    return f"decode batch {batch_size} context {ctx}"


def prefill_label(ctx: int, q_len: int) -> str:
    return f"prefill {q_len} tokens" + (f" after a {ctx}-token prefix" if ctx else "")


def prefill_shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    return [(0, length) for length in args.prefill_len_list] + [(args.prefix_len, args.chunk_len)]


def run_decode(args: argparse.Namespace, spec: AttentionSpec, timer: Timer, copy_gbs: float, torch_ok: bool, report: PartReport) -> None:
    """Decode rows into ``report.results["decode"]``, each backend of each row a named check."""
    import torch

    gen = torch.Generator().manual_seed(args.seed)
    elem = torch.empty((), dtype=spec.dtype).element_size()
    rows = report.results["decode"]
    for batch_size in args.decode_batch_list:
        for ctx in args.decode_context_list:
            label = decode_label(batch_size, ctx)
            kv_bytes = batch_size * (ctx + 1) * spec.num_kv_heads * spec.head_size * 2 * elem
            if kv_bytes > args.max_kv_gib * GIB:
                print(f"  skip {label}: cache {kv_bytes / GIB:.1f} GiB > --max-kv-gib")
                continue
            row: dict[str, Any] = {"batch": batch_size, "context": ctx, "kv_bytes": kv_bytes}
            rows.append(row)
            with report.check(f"{label}: inputs and float32 reference"):
                step = make_step(spec, [(ctx, 1)] * batch_size, gen, timer.device)
                ref_rows, ref = reference(spec, step)
            names = ["triton", "triton-nosplit"]
            if torch_ok and kv_bytes <= args.torch_max_kv_gib * GIB:
                names.append("torch")
            for name in names:
                with report.check(f"{label}: {name}", catch=True):
                    ms, out, plan = time_backend(name, spec, step, timer)
                    row[name] = _decode_entry(ms, kv_bytes, copy_gbs, rel_err(out[ref_rows], ref))
                    if name == "triton":
                        row["num_splits"] = plan.num_splits
            if timer.device.type == "cuda":
                with report.check(f"{label}: triton-graph", catch=True):
                    ms, out = time_graph(spec, step, timer)
                    row["triton-graph"] = _decode_entry(ms, kv_bytes, copy_gbs, rel_err(out[ref_rows], ref))
            del step
            _print_decode(row)


def _decode_entry(ms: float, kv_bytes: int, copy_gbs: float, err: float) -> dict[str, float]:
    gbs = kv_bytes / (ms * 1e-3) / 1e9
    return {"ms": ms, "gb_per_s": gbs, "fraction_of_copy_bw": gbs / copy_gbs, "rel_err": err}


def causal_pairs(reqs: list[tuple[int, int]]) -> int:
    return sum(q * c + q * (q + 1) // 2 for c, q in reqs)


def sdpa(spec: AttentionSpec, step: dict[str, Any]) -> tuple[Callable[[], Any], Callable[[], torch.Tensor]]:
    """SDPA on contiguous per-request tensors (equal lengths: one batched call); returns (fn, output-as-rows)."""
    import torch
    import torch.nn.functional as F

    reqs = step["reqs"]
    n, (ctx, q_len) = len(reqs), reqs[0]
    q = step["query"].view(n, q_len, spec.num_heads, spec.head_size).transpose(1, 2).contiguous()
    if ctx == 0:
        k = step["key"].view(n, q_len, spec.num_kv_heads, spec.head_size).transpose(1, 2).contiguous()
        v = step["value"].view(n, q_len, spec.num_kv_heads, spec.head_size).transpose(1, 2).contiguous()
        mask, causal = None, True
    else:  # gather prefix + chunk once (outside the timing): SDPA reads contiguous K/V
        kv = [gather_sequence(spec, step, i) for i in range(n)]
        k = torch.stack([k for k, _ in kv]).transpose(1, 2).contiguous()
        v = torch.stack([v for _, v in kv]).transpose(1, 2).contiguous()
        pos = torch.arange(ctx + q_len, device=q.device)
        mask = pos[None, :] <= (ctx + torch.arange(q_len, device=q.device))[:, None]
        causal = False
    group = spec.num_heads // spec.num_kv_heads
    out: dict[str, torch.Tensor] = {}

    def fn() -> None:
        out["o"] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=group > 1)

    return fn, lambda: out["o"].transpose(1, 2).reshape(n * q_len, spec.num_heads, spec.head_size)


def run_prefill(args: argparse.Namespace, spec: AttentionSpec, timer: Timer, torch_ok: bool, report: PartReport) -> None:
    """Prefill rows into ``report.results["prefill"]``, each peer of each row a named check."""
    import torch

    gen = torch.Generator().manual_seed(args.seed + 1)
    rows = report.results["prefill"]
    for ctx, q_len in prefill_shapes(args):
        label = prefill_label(ctx, q_len)
        reqs = [(ctx, q_len)] * args.prefill_requests
        flops = 4 * spec.head_size * spec.num_heads * causal_pairs(reqs)
        row: dict[str, Any] = {"requests": len(reqs), "prefix": ctx, "query_len": q_len, "flops": flops}
        rows.append(row)
        with report.check(f"{label}: inputs and float32 reference"):
            step = make_step(spec, reqs, gen, timer.device)
            ref_rows, ref = reference(spec, step, max_reqs=1)
        with report.check(f"{label}: triton", catch=True):
            ms, out, _ = time_backend("triton", spec, step, timer)
            row["triton"] = _prefill_entry(ms, flops, rel_err(out[ref_rows], ref))
        with report.check(f"{label}: sdpa", catch=True):
            fn, sdpa_out = sdpa(spec, step)
            ms = timer(fn)
            row["sdpa"] = _prefill_entry(ms, flops, rel_err(sdpa_out()[ref_rows], ref))
        kv_bytes = sum(c + q for c, q in reqs) * spec.num_kv_heads * spec.head_size * 2 * spec.dtype.itemsize
        if torch_ok and kv_bytes <= args.torch_max_kv_gib * GIB and q_len <= 2048:
            with report.check(f"{label}: torch", catch=True):
                ms, out, _ = time_backend("torch", spec, step, timer)
                row["torch"] = _prefill_entry(ms, flops, rel_err(out[ref_rows], ref))
        del step
        _print_prefill(row)


def _prefill_entry(ms: float, flops: int, err: float) -> dict[str, float]:
    return {"ms": ms, "tflop_per_s": flops / (ms * 1e-3) / 1e12, "rel_err": err}


# ---------------------------------------------------------------------------------------------- report
DECODE_PEERS = ("triton", "triton-graph", "triton-nosplit", "torch")


def _print_decode(row: dict) -> None:
    cells = []
    for name in DECODE_PEERS:
        e = row.get(name)
        cells.append(f"{e['gb_per_s']:8.0f} GB/s {e['fraction_of_copy_bw']:5.0%}" if e else f"{'-':>19}")
    print(f"  {row['batch']:>5} {row['context']:>7} {row.get('num_splits', '-'):>6} " + " ".join(cells))


def _print_prefill(row: dict) -> None:
    def cell(name: str) -> str:
        return f"{row[name]['tflop_per_s']:8.1f}" if name in row else f"{'-':>8}"

    ratio = f"{row['triton']['tflop_per_s'] / row['sdpa']['tflop_per_s']:7.2f}" if "triton" in row and "sdpa" in row else f"{'-':>7}"
    print(f"  {row['requests']:>4} {row['prefix']:>7} {row['query_len']:>7} {cell('triton')} {cell('sdpa')} {ratio} {cell('torch')}")


def max_error(results: dict) -> float:
    errs = [e["rel_err"] for section in ("decode", "prefill") for row in results[section] for e in row.values()
            if isinstance(e, dict) and "rel_err" in e]
    return max(errs, default=0.0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_path = args.out / "bench_attention.json" if args.out.is_dir() or args.out.suffix != ".json" else args.out
    report = PartReport(out_path, "bench-attention", dry_run=args.dry_run)
    results = report.results
    results.update(decode=[], prefill=[])
    if args.dry_run:
        return report.rehearse(
            [decode_label(b, c) for b in args.decode_batch_list for c in args.decode_context_list]
            + [prefill_label(c, q) for c, q in prefill_shapes(args)]
        )
    if args.smoke:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from corerun.protocols.attention import AttentionSpec

    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or pass --smoke to exercise the script on CPU", file=sys.stderr)
        report.finish(False)
        return 2
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    spec = AttentionSpec(
        num_heads=args.heads, num_kv_heads=args.kv_heads, head_size=args.head_size, dtype=dtype,
        block_size=args.block_size, device=device,
    )
    import triton

    from corerun_attention_triton.probe import mode

    timer = Timer(device, args.warmup, args.iters)
    torch_missing = torch_backend_available()
    results.update({
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "smoke": args.smoke,
        "mode": mode(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "spec": {"num_heads": args.heads, "num_kv_heads": args.kv_heads, "head_size": args.head_size,
                 "dtype": args.dtype, "block_size": args.block_size},
        "torch_backend": "available" if torch_missing is None else f"unavailable ({torch_missing})",
    })
    with report.check("device copy bandwidth"):
        copy_gbs = copy_bandwidth(device, timer, args.smoke)
        results["copy_bandwidth_gb_per_s"] = copy_gbs
    print(f"{results['device']} | triton {triton.__version__} ({mode()}) | torch {torch.__version__} | {args.dtype}")
    print(f"heads {args.heads}/{args.kv_heads}, head size {args.head_size}, block size {args.block_size}")
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)\n", flush=True)

    print("decode: K/V bytes read per second, and as a fraction of the copy bandwidth")
    print(f"  {'batch':>5} {'context':>7} {'splits':>6} " + " ".join(f"{n:>19}" for n in DECODE_PEERS), flush=True)
    run_decode(args, spec, timer, copy_gbs, torch_missing is None, report)

    print("\nprefill: attention TFLOP/s (causal pairs only)")
    print(f"  {'reqs':>4} {'prefix':>7} {'q_len':>7} {'triton':>8} {'sdpa':>8} {'tri/sdpa':>7} {'torch':>8}", flush=True)
    run_prefill(args, spec, timer, torch_missing is None, report)

    worst = max_error(results)
    results["max_rel_err"] = worst
    print(f"\nworst rel_err vs float32 reference: {worst:.2e} (limit {args.max_error:g}); JSON: {out_path}", flush=True)
    return report.finish(worst <= args.max_error and all(c.get("ok") is not False for c in report.doc["checks"]))


if __name__ == "__main__":
    sys.exit(main())
