"""Greedy output of the default model with a quantized KV cache against the unquantized one, side by side.

16 short prompts, 32 tokens each (EOS ignored), greedy, one engine per ``kv_cache.dtype`` in one process
(same weights, same attention backend).  For each quantized format the script counts the prompts whose 32
tokens equal the unquantized cache's, and for the others the position where they part; then, feeding each
prompt with the unquantized run's 32 tokens as one prompt, the share of those tokens the quantized cache
also ranks first (agreement free of the snowball after a first difference).  It prints the cache's block
count in the same memory (``kv_cache.cpu_memory_gb``) and, for scale, the same figures for the unquantized
cache with the whole model in bfloat16 (``--floor``).

    .venv/bin/python benchmarks/kv_quant_check.py [--formats fp8_e4m3,fp8_e5m2,int8] [--tokens 32] [--attention cpu]

``--explore`` asks instead what limits fp8_e4m3: per layer, the largest |K| and |V|, the share of entries below
2**-6 (e4m3's subnormals at scale 1) and the relative rounding error of K and V at scale 1 and at a calibrated
``amax / 448``; then the agreement of variants, each fake-quantized where a layer's K/V enter attention (the
cache then holds the rounded values): ``e4m3`` (scale 1), ``e4m3-calibrated`` (per layer ``amax / 448`` from the
first forward with tokens, then frozen, as vLLM's ``calculate_kv_scales``), ``e4m3-centred`` (per layer and
KV head, the mean K of that first forward subtracted before rounding and added back), ``e4m3-rotated`` (each
64-value head row of K and V turned by one orthonormal Hadamard matrix with random signs before rounding and
turned back after: attention is unchanged by the turn, and an outlier channel's rounding is spread over the row)
and ``int8-f16scale`` (int8 rows with a float16 scale).
"""

from __future__ import annotations

import argparse
import functools
import os
import time

from dtype_greedy_check import TEXTS  # (this folder is the script's sys.path[0])

PROMPTS = TEXTS + [
    "The three primary colors are",
    "A good breakfast includes",
    "In 1969, the first humans",
    "To boil an egg, you",
    "import numpy as np\narr = np.",
    "The largest planet in the solar system is",
    "Rain forms when",
    "My favourite book is",
]


def run(tokens: int, attention: str, dtype: str, kv_dtype: str, base: list | None, on_new_engine=None) -> dict:
    """One engine: free-running greedy outputs, the cache's block count, and (given the baseline's outputs) the
    share of the baseline's tokens this engine ranks first when fed the baseline's own context."""
    from corerun.llm import LLM
    from corerun.sampling_params import SamplingParams

    llm = LLM(device="cpu", dtype=dtype, attention=attention, kv_cache={"dtype": kv_dtype, "cpu_memory_gb": 0.5})
    start = time.perf_counter()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    took = time.perf_counter() - start
    res = {"outs": [list(o.outputs[0].token_ids) for o in outs], "prompts": [list(o.prompt_token_ids) for o in outs],
           "blocks": getattr(llm.engine.runner, "num_blocks", -1), "s": took}
    if base is not None:  # teacher-forced: prompt + the baseline's tokens as one prompt, their ranks read back
        if on_new_engine is not None:  # (--explore: the teacher-forced pass calibrates anew, as a new engine would)
            on_new_engine()
        forced = [p + o for p, o in zip(base["prompts"], base["outs"])]
        ranked = llm.generate(forced, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        firsts = total = 0
        for p, r in zip(base["prompts"], ranked):
            for entry, tok in zip(r.prompt_logprobs[len(p):], r.prompt_token_ids[len(p):]):
                firsts += entry[tok].rank == 1
                total += 1
        res["forced"] = firsts / total
    llm.shutdown()
    return res


class FakeQuant:
    """Rounds each layer's K/V as ``mode`` says before ``AttentionContext.attend`` hands them on (``--explore``)."""

    def __init__(self, mode: str) -> None:
        self.mode, self.calibration = mode, {}

    def __call__(self, layer: int, k, v):
        import torch

        if self.mode == "e4m3":
            return fp8(k, 1.0), fp8(v, 1.0)
        if self.mode == "int8-f16scale":
            return int8_f16(k), int8_f16(v)
        if self.mode == "e4m3-rotated":
            return rotated_fp8(k), rotated_fp8(v)
        if layer not in self.calibration and k.shape[0]:  # the first forward with tokens, then frozen
            mu = k.float().mean(0, keepdim=True) if self.mode == "e4m3-centred" else torch.zeros_like(k[:1]).float()
            calibrated = self.mode == "e4m3-calibrated"
            self.calibration[layer] = (mu, (k.float() - mu).abs().max().item() / 448 if calibrated else 1.0,
                                       v.float().abs().max().item() / 448 if calibrated else 1.0)
        mu, ks, vs = self.calibration[layer]
        return (fp8(k.float() - mu, ks) + mu).to(k.dtype), fp8(v, vs)


def fp8(x, scale: float):
    import torch

    return ((x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


@functools.lru_cache(maxsize=None)
def turn(head_size: int):
    """A Hadamard matrix with random signs, scaled to be orthonormal (made once: a replayed step cannot draw it)."""
    import torch

    h = torch.ones(1, 1)
    while h.shape[0] < head_size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.where(torch.rand(head_size, generator=torch.Generator().manual_seed(0)) < 0.5, -1.0, 1.0)
    return h * signs / head_size**0.5


def rotated_fp8(x, head_size: int = 64):
    """``x`` ``[..., heads * head_size]`` rounded to e4m3 (scale 1) in a turned basis: ``fp8(x R) R^T`` per head row,
    ``R`` :func:`turn`'s."""
    r = turn(head_size)
    rows = x.float().reshape(-1, head_size)
    return (fp8(rows @ r, 1.0).float() @ r.T).reshape(x.shape).to(x.dtype)


def int8_f16(x):
    from corerun.protocols.kv_quant import int8_scale

    scale = int8_scale(x.float()).float()
    return ((x.float() / scale).round().clamp(-127, 127) * scale).to(x.dtype)


def explore(args) -> None:
    """Per-layer statistics of the unquantized run's K/V, then the variants' agreement (see the module docstring)."""
    import torch

    from corerun.protocols import forward_context

    attend, seen, hook = forward_context.AttentionContext.attend, {}, None

    def patched(ctx, layer, q, k, v):
        if hook is None:
            seen.setdefault(layer, []).append((k.float().clone(), v.float().clone()))
        else:
            k, v = hook(layer, k, v)
        return attend(ctx, layer, q, k, v)

    forward_context.AttentionContext.attend = patched
    base = run(args.tokens, args.attention, args.dtype, "auto", None)
    print("layer: max|K| K<2^-6 max|V| V<2^-6 | e4m3 rel. error of K, V at scale 1; at amax/448")
    for layer, kv in sorted(seen.items()):
        k, v = (torch.cat([t[i] for t in kv]) for i in (0, 1))
        err = lambda x, s: ((fp8(x, s) - x).norm() / x.norm()).item()  # noqa: E731
        ka, va = k.abs().max().item(), v.abs().max().item()
        print(f"{layer:5d}: {ka:6.2f} {(k.abs() < 2**-6).float().mean():6.1%} {va:6.2f} {(v.abs() < 2**-6).float().mean():6.1%}"
              f" | {err(k, 1):.4f} {err(v, 1):.4f}; {err(k, ka / 448):.4f} {err(v, va / 448):.4f}")
    for mode in ("e4m3", "e4m3-calibrated", "e4m3-centred", "e4m3-rotated", "int8-f16scale"):
        hook = FakeQuant(mode)
        r = run(args.tokens, args.attention, args.dtype, "auto", base, on_new_engine=lambda: hook.calibration.clear())
        same = sum(o == x for o, x in zip(r["outs"], base["outs"]))
        print(f"{mode:>18}: {same}/{len(base['outs'])} prompts identical; teacher-forced top-1 agreement "
              f"{r['forced']:.1%}; load average {os.getloadavg()[0]:.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="fp8_e4m3,fp8_e5m2,int8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--dtype", default="auto", help="the model's dtype (auto: float32 on CPU)")
    ap.add_argument("--explore", action="store_true", help="what limits fp8_e4m3 (see the module docstring)")
    ap.add_argument("--floor", default="bfloat16", help="also run the unquantized cache with the model in this dtype "
                    "(the agreement a change of rounding alone gives); empty: skip")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}; {len(PROMPTS)} prompts x {args.tokens} greedy tokens; "
          f"model dtype {args.dtype}, attention {args.attention}")
    if args.explore:
        return explore(args)
    base = run(args.tokens, args.attention, args.dtype, "auto", None)
    print(f"{'auto':>18}: {base['blocks']} blocks in 0.5 GiB, {base['s']:.1f} s")
    rows = [(kv, args.dtype, kv) for kv in args.formats.split(",")]
    if args.floor:
        rows.append((f"auto, {args.floor} model", args.floor, "auto"))
    for label, dtype, kv in rows:
        r = run(args.tokens, args.attention, dtype, kv, base)
        outs, b = r["outs"], base["outs"]
        same = sum(o == x for o, x in zip(outs, b))
        parts = sorted(next(i for i, (x, y) in enumerate(zip(o, q)) if x != y) for o, q in zip(outs, b) if o != q)
        print(f"{label:>18}: {same}/{len(b)} prompts identical (the others part at output token {parts}); "
              f"teacher-forced top-1 agreement {r['forced']:.1%}; {r['blocks']} blocks "
              f"({r['blocks'] / base['blocks']:.2f}x), {r['s']:.1f} s")


if __name__ == "__main__":
    main()
