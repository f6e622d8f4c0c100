"""The LoRA kernels on CPU: the ``torch`` reference (a gather per token) against ``grouped`` (one pair of
products per adapter present), side by side, interleaved, best of ``--repeats``.

One merged q/k/v layer of SmolLM2-135M's shape (576 -> 576 + 192 + 192) and one gate/up layer
(576 -> 1536 + 1536), ``--slots`` adapters of rank ``--rank``, the tokens spread over the adapters and
the base model (slot -1) in turn; ms per call of ``add_lora`` with the step's bookkeeping
(:class:`corerun.lora.tokens.LoRATokens`) built beforehand, as the engine builds it once per step,
and the ratio reference / grouped; ``step`` is that bookkeeping's own cost, paid once per step
whatever the number of layers.

``--before FILE`` also times the ``GroupedLoRAKernel`` of an earlier ``corerun/lora/grouped.py``
(one whose ``add_lora`` takes the tokens' slots and sorts and counts them in every call, e.g.
``git show REV:corerun/lora/grouped.py > /tmp/grouped_before.py``), interleaved with the others.

    .venv/bin/python benchmarks/lora_kernel_bench.py --threads 1 --tokens 1,16,256
"""

from __future__ import annotations

import argparse
import importlib.util
import os

import corerun  # noqa: F401  (before torch: its OpenMP settings, corerun.platform.host)
import torch
from linear_bench import best_ms  # benchmarks/ is the script's folder: on sys.path

from corerun.lora.grouped import GroupedLoRAKernel
from corerun.lora.reference import TorchLoRAKernel
from corerun.lora.tokens import LoRATokens

LAYERS = {"qkv": (576, (576, 192, 192)), "gate_up": (576, (1536, 1536))}


def _before(path: str):
    """The ``GroupedLoRAKernel`` of an earlier grouped.py, loaded from ``path``."""
    spec = importlib.util.spec_from_file_location("grouped_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GroupedLoRAKernel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", default="1,16,256")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--before", default=None, help="an earlier grouped.py whose kernel takes the tokens' slots")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.slots} slots of rank {args.rank}, "
          f"load {os.getloadavg()[0]:.2f} at start; ms per add_lora call, best of {args.repeats}")
    kernels = {"torch": TorchLoRAKernel(), "grouped": GroupedLoRAKernel()}
    before = _before(args.before) if args.before else None
    g = torch.Generator().manual_seed(0)
    extra = f" {'before':>9} {'before/grouped':>14}" if before else ""
    print(f"{'dtype':9} {'layer':8} {'tokens':>6} {'step':>7} {'torch':>9} {'grouped':>9} {'torch/grouped':>14}{extra}")
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for layer, (h_in, slices) in LAYERS.items():
            a = [torch.randn(args.slots, args.rank, h_in, generator=g).to(dtype) * 0.05 for _ in slices]
            b = [torch.randn(args.slots, out, args.rank, generator=g).to(dtype) * 0.05 for out in slices]
            scalings = torch.full((args.slots,), 2.0)
            for n in (int(t) for t in args.tokens.split(",")):
                x = torch.randn(n, h_in, generator=g).to(dtype)
                y = torch.randn(n, sum(slices), generator=g).to(dtype)
                slots = (torch.arange(n, dtype=torch.int32) % (args.slots + 1)) - 1  # -1, 0, 1, ... in turn
                if n == 1:
                    slots.fill_(0)
                tokens = LoRATokens(args.slots, n, "cpu")
                tokens.update(slots)  # (and again in the timed "step" calls, to the same values)
                calls = {name: (lambda k=kernel: k.add_lora(y, x, a, b, scalings, tokens, slices)) for name, kernel in kernels.items()}
                if before:
                    calls["before"] = lambda: before.add_lora(y, x, a, b, scalings, slots, slices)
                calls["step"] = lambda: tokens.update(slots)
                ms = {name: float("inf") for name in calls}
                for _ in range(2):  # interleaved rounds
                    for name, call in calls.items():
                        ms[name] = min(ms[name], best_ms(call, args.repeats))
                row = (f"{str(dtype).removeprefix('torch.'):9} {layer:8} {n:6d} {ms['step']:7.3f} {ms['torch']:9.3f} "
                       f"{ms['grouped']:9.3f} {ms['torch'] / ms['grouped']:14.2f}")
                if before:
                    row += f" {ms['before']:9.3f} {ms['before'] / ms['grouped']:14.2f}"
                print(row)
    print(f"load {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
