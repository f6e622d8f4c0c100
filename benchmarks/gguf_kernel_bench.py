"""GGUF products on CPU: corerun-quant-cpu's kernel against the decode-per-call path and dense float32.

For the default model's linear shapes (SmolLM2-135M: hidden 576, intermediate 1536, q/k/v merged
960 rows, gate/up merged 3072, and 192-column row shards of a 3-rank split), each GGUF type the
kernel reads, and a few token counts, the time of ``y = x @ W.T`` by:

- ``kernel`` / ``avx2`` / ``scalar``: ``corerun_quant_cpu.kernels.gguf_gemv`` on the packed blocks (the best
  path here, AVX-512 + VNNI with int8 activations where the CPU has it; the float AVX2 path; forced scalar);
- ``decode``: the built-in ``gguf`` method's path, the blocks dequantized to float32 in torch, then ``F.linear``;
- ``cdecode``: the blocks dequantized by the kernel library (``gguf_dequantize``), then ``F.linear`` (gguf_cpu's prefill path);
- ``dense``: ``F.linear`` on a float32 weight already in memory (what a float model streams);
- ``repacked``: Q8_0 only, on AVX-512 + VNNI: the weights repacked once (``kernels.repack_q8_0``: codes
  of a row in a row of their own, in the order the integer dot products sum them; scales apart), then
  ``kernels.gguf_gemv_q8_0_repacked``, gguf_cpu's Q8_0 path there; ``kernel`` is then the product
  straight from the 34-byte blocks, kept for this comparison;
- ``q8act``: llama.cpp's way, for comparison only (``gguf_gemv_q8``, not used by ``gguf_cpu``): the
  activations quantized to int8 per 32-block once per call, integer dot products per block.

``--types Q4_K,Q5_K,Q6_K``: the K types (``csrc/gguf_k.cpp``), on random super-blocks (the gguf package only
decodes them), for the shapes whose columns are a multiple of 256.

Interleaved rounds, median of ``--repeats``; "GB/s" is the weight's stored bytes (packed for the
GGUF paths, 4 bytes a value for dense) over the time.  One thread unless ``--threads``.  ``--copies N``
makes N copies of each weight and multiplies by each in turn, so that a product finds its weight in
the L3 cache or memory (as in a model's step) rather than in L2 from the call before.

    .venv/bin/python benchmarks/gguf_kernel_bench.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import corerun  # noqa: F401  (before torch: its OpenMP settings, corerun.platform.host)
import torch
import torch.nn.functional as F

from corerun.quantization.gguf_tensor import GGUFTensor
from corerun_quant_cpu import kernels

SHAPES = [(576, 576), (576, 1536), (1536, 576), (192, 576), (576, 960), (576, 3072)]  # (in, out)
# the K types' rows are 256-value super-blocks: of these shapes only 1536 columns take them; --shapes 2048x2048,2048x5632
# for a 1B model's


def _time(fn, inner: int, clock=time.perf_counter) -> float:
    t = clock()
    for _ in range(inner):
        fn()
    return (clock() - t) / inner * 1e3


def _cdecoded(packed: torch.Tensor, rows: int, cols: int, type_name: str, isa: str) -> torch.Tensor:
    w = torch.empty(rows, cols)
    kernels.gguf_dequantize(w, packed, type_name, isa)
    return w


def _packed(gguf, type_name: str, rows: int, cols: int, rng: np.random.Generator) -> torch.Tensor:
    """A weight of that type: quantized by the gguf package, or (the K types, which it only decodes) random
    super-blocks, every code and 6-bit scale random, float16 ``d`` and ``dmin`` of a weight's size."""
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name not in kernels.K_TYPES:
        w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        return torch.from_numpy(gguf.quants.quantize(w, qtype))
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    scales = (rng.uniform(2e-4, 1e-3, size=(raw.shape[0], 2))).astype(np.float16).view(np.uint8)
    if type_name == "Q6_K":
        raw[:, -2:] = scales[:, :2]  # d last
    else:
        raw[:, :4] = scales  # d, dmin first
    return torch.from_numpy(raw.reshape(rows, -1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--types", default="Q4_1,Q8_0,Q4_0")
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--shapes", default="all", help="'all' or in x out pairs like 576x576,1536x576")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this thread's CPU time (time.thread_time), which leaves out the time other processes hold the core")
    ap.add_argument("--paths", default="all", help="'all' or some of kernel,avx2,scalar,decode,cdecode,dense,q8act,repacked (kernel always runs)")
    ap.add_argument("--copies", type=int, default=1, help="copies of each weight, multiplied in turn (weights out of L2)")
    args = ap.parse_args()
    import gguf

    torch.set_num_threads(args.threads)
    reasons = kernels.load()
    if reasons:
        raise SystemExit("; ".join(reasons))
    isa = kernels.best_isa()
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    shapes = SHAPES if args.shapes == "all" else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print(f"threads {args.threads}, kernel isa {isa}, median of {args.repeats} interleaved rounds, {args.clock} clock, {args.copies} copies of each weight")
    print(f"{'type':5} {'in x out':>10} {'T':>3} | " + " | ".join(f"{p:>16}" for p in ("kernel", "avx2", "scalar", "decode", "cdecode", "dense", "q8act", "repacked"))
          + " | avx2/kernel decode/kernel cdecode/kernel dense/kernel q8act/kernel repacked/kernel")
    rng = np.random.default_rng(0)
    for type_name in args.types.split(","):
        for cols, rows in shapes:
            if cols % (256 if type_name in kernels.K_TYPES else 32):
                continue  # not a whole number of that type's blocks per row
            copies = []
            for _ in range(args.copies):
                packed = _packed(gguf, type_name, rows, cols, rng)
                tensor = GGUFTensor("w", type_name, packed, cols)
                repacked = kernels.repack_q8_0(packed) if type_name == "Q8_0" and isa == "avx512" else None
                copies.append((packed, tensor, tensor.dequantize(torch.float32), repacked))
            for tokens in (int(t) for t in args.tokens.split(",")):
                x = torch.randn(tokens, cols)
                out = torch.empty(tokens, rows)
                inner = max(1, int(2e6 // (rows * cols * args.copies)))  # about 2M weights a sample
                one = {  # one product, with copy (packed, tensor, dense, repacked)
                    "kernel": lambda c: kernels.gguf_gemv(out, c[0], x, type_name, isa),
                    "avx2": lambda c: kernels.gguf_gemv(out, c[0], x, type_name, "avx2"),
                    "scalar": lambda c: kernels.gguf_gemv(out, c[0], x, type_name, "scalar"),
                    "decode": lambda c: F.linear(x, c[1].dequantize(torch.float32)),
                    "cdecode": lambda c: F.linear(x, _cdecoded(c[0], rows, cols, type_name, isa)),
                    "dense": lambda c: F.linear(x, c[2]),
                    "q8act": lambda c: torch.ops.corerun_quant_cpu.gguf_gemv_q8(out, c[0], x, kernels.TYPES[type_name]),
                    "repacked": lambda c: kernels.gguf_gemv_q8_0_repacked(out, *c[3], x),
                }
                paths = {p: (lambda f=f: [f(c) for c in copies]) for p, f in one.items()}
                if repacked is None:
                    del paths["repacked"]
                if type_name in kernels.K_TYPES:  # llama.cpp's way for comparison exists for the 32-value types only
                    del paths["q8act"]
                if args.paths != "all":  # the others are not timed, and leave the caches alone
                    paths = {p: fn for p, fn in paths.items() if p == "kernel" or p in args.paths.split(",")}
                if "avx2" not in kernels.runnable_isas():  # both AVX2 code, refused on a CPU without it: not timed
                    paths.pop("avx2", None), paths.pop("q8act", None)
                samples: dict[str, list[float]] = {p: [] for p in paths}
                for fn in paths.values():
                    fn()
                for _ in range(args.repeats):
                    for p, fn in paths.items():
                        samples[p].append(_time(fn, inner, clock) / args.copies)
                ms = {p: statistics.median(v) for p, v in samples.items()}
                nbytes = {p: packed.numel() for p in ("kernel", "avx2", "scalar", "decode", "cdecode")} | {"dense": rows * cols * 4, "q8act": packed.numel(), "repacked": packed.numel()}
                cells = [f"{ms[p]:7.4f}ms {nbytes[p] / ms[p] / 1e6:5.1f}GB/s" if p in ms else f"{'-':>16}" for p in nbytes]
                ratios = [f"{ms[p] / ms['kernel']:.2f}x" if p in ms else "-" for p in ("avx2", "decode", "cdecode", "dense", "q8act", "repacked")]
                print(f"{type_name:5} {cols:>4}x{rows:<5} {tokens:>3} | " + " | ".join(cells) + " | " + " ".join(ratios))


if __name__ == "__main__":
    main()
