"""Decode steps of the default model with the residual stream (the adds fused into the norms) against the
Llama layer's two adds, taking turns in one process.

'two adds' patches the layer of before back in (``hidden + attn(norm(hidden))``, then ``+ mlp(norm(...))``,
two torch adds and two plain norms per layer) together with oneDNN's dtype question asked per product;
'stream' is the tree as it is (``LlamaDecoderLayer.forward_residual``, ``fused_ops.add_rms_norm``).  Each
round runs one untimed step after the switch and then ``--steps`` timed decode steps of every request;
the two take turns, first one then the other, so the context grows alike for both.  Prints the median step
of each and their ratio, with the load; the hidden states of one step are compared bit for bit.

    .venv/bin/python benchmarks/residual_stream_ab.py --dtype bfloat16 --batch 32 [--rounds 8] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import corerun  # noqa: F401  (before torch: its OpenMP settings, corerun.platform.host)
    import torch

    import corerun.models.layers as layers
    from corerun import LLM, SamplingParams
    from corerun.models.llama import LlamaDecoderLayer

    def two_adds(self, rope, hidden, ctx):  # the layer before the residual stream
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), ctx)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def packable_asked_per_product(weight):
        if weight.device.type != "cpu" or weight.dim() != 2 or weight.requires_grad or not torch.backends.mkldnn.is_available():
            return False
        return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))

    llm = LLM(model=None, device="cpu", dtype=args.dtype, attention="cpu", threads=args.threads, graph={"runner": {"name": "eager"}})
    engine, model = llm.engine, llm.engine.runner.model.model
    variants = {"two adds": (two_adds, packable_asked_per_product, False),
                "stream": (LlamaDecoderLayer.forward, layers._packable, True)}

    def use(name: str) -> None:
        LlamaDecoderLayer.forward, layers._packable, model.residual_stream = variants[name]

    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request([rng.randrange(10000) for _ in range(args.context)], params)
    for _ in range(4):  # the prefills and a first decode
        engine.step()
    runner, captured = engine.runner, []
    inner = runner._forward
    runner._forward = lambda inputs: captured.append(inputs) or inner(inputs)
    engine.step()
    runner._forward = inner
    hidden = {}
    for name in variants:  # the same step's inputs again under each (the same K/V written to the same slots)
        use(name)
        with torch.no_grad():
            hidden[name] = inner(captured[0])
    same = torch.equal(*hidden.values())
    times: dict[str, list[float]] = {name: [] for name in variants}
    load = os.getloadavg()[0]
    for r in range(args.rounds):
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            use(name)
            engine.step()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                engine.step()
                times[name].append((time.perf_counter() - t0) * 1e3)
    a, b = (statistics.median(times[n]) for n in variants)
    print(f"{args.dtype}, {args.batch} request(s), {args.threads} thread(s), load {load:.2f} -> {os.getloadavg()[0]:.2f}: "
          f"decode step median two adds {a:.2f} ms, stream {b:.2f} ms, stream / two adds {b / a:.3f} "
          f"({len(times['stream'])} steps each); hidden states {'equal' if same else 'DIFFERENT'} bit for bit")


if __name__ == "__main__":
    main()
