"""The 4-bit group-wise product (GPTQ, AWQ, W4A16) on CPU: corerun-quant-cpu's kernel against decoding then torch's
matmul, by token count, through the default model's 120 decoder products.

SmolLM2-135M's linear shapes (30 layers of q/k/v merged 960 x 576, o 576 x 576, gate/up merged 3072 x 576, down
576 x 1536), random 4-bit codes with groups of 64 (what ``corerun quantize --method int4 --group-size 64`` writes),
repacked as ``w4_method`` does (``kernels.repack_w4``).  For each token count the time of all 120 products by:

- ``kernel``: ``kernels.w4_gemv`` (AVX-512 VNNI, int8 activations per 32-block), the path up to ``W4_MAX_TOKENS``;
- ``f32``: ``kernels.w4_dequantize`` then ``F.linear`` in float32 (a float32 model's path above it);
- ``bf16``: the same decode rounded to bfloat16, ``F.linear`` in bfloat16 (a bfloat16 model's path above it);
- ``decode``: the decode alone.

Best of ``--repeats`` rounds; the weights fit no cache level (about 53 MB of codes).  One thread unless ``--threads``.

    PYTHONPATH=plugins/quant_cpu .venv/bin/python benchmarks/w4_prefill_bench.py --tokens 16,32,64,128,256
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # one layer's products (rows, columns)
LAYERS = 30


def main() -> None:
    from corerun_quant_cpu import kernels

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="16,32,64,128,256")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paths", default="decode,f32,bf16,kernel")
    ap.add_argument("--layers", type=int, default=LAYERS, help="decoder layers' products (30: the default model's)")
    args = ap.parse_args()
    reasons = kernels.load()
    if reasons or not kernels.w4_available():
        raise SystemExit("the 4-bit kernel cannot run here: " + ("; ".join(reasons) or f"this CPU runs {kernels.best_isa()!r}"))
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    weights = []
    shapes = SHAPES * args.layers
    for rows, cols in shapes:
        q = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.int32)
        z = torch.full((rows, cols // 64), 8, dtype=torch.int32)
        s = (torch.rand(rows, cols // 64, generator=g) * 0.01).half().float()
        weights.append(kernels.repack_w4(q, z, s, torch.arange(cols) // 64))
    tokens = [int(t) for t in args.tokens.split(",")]
    xs = {(t, c): torch.randn(t, c, generator=g) for t in tokens for c in {c for _, c in SHAPES}}

    def run(t: int, path: str) -> float:
        start = time.perf_counter()
        for (codes, scales, negzs, gb), (rows, cols) in zip(weights, shapes):
            x = xs[(t, cols)]
            if path == "kernel":
                kernels.w4_gemv(torch.empty(t, rows), codes, scales, negzs, x, gb)
            elif path == "decode":
                kernels.w4_dequantize(codes, scales, negzs, gb)
            elif path == "f32":
                F.linear(x, kernels.w4_dequantize(codes, scales, negzs, gb))
            else:
                F.linear(x.bfloat16(), kernels.w4_dequantize(codes, scales, negzs, gb).bfloat16())
        return (time.perf_counter() - start) * 1000

    print(f"{len(weights)} products, {args.threads} thread(s); ms, best of {args.repeats}")
    for t in tokens:
        times = {}
        for path in args.paths.split(","):
            run(t, path)  # warm
            times[path] = min(run(t, path) for _ in range(args.repeats))
        print(f"{t:5d} tokens: " + "  ".join(f"{p} {ms:7.1f}" for p, ms in times.items()), flush=True)


if __name__ == "__main__":
    main()
