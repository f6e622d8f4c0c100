"""The quantization method conformance suite: a method's layers against float64 dequantize-then-matmul.

For every GGUF block type the method declares (``capabilities.gguf_types``), a weight is encoded by
an independent reference: random float64 weights quantized by the ``gguf`` package's own quantizer
(``gguf.quants.quantize``; Q8_0, Q4_0, Q4_1), or, for the K types it has no quantizer for, random
codes with random float16 scales; ``gguf.quants.dequantize`` (numpy) decodes them into the
reference weight ``W``.  Checks, each through corerun's own layers:

- ``matmul``: a plain linear layer's output for float32 activations against ``x @ W.T`` in float64,
  within ``8 * sqrt(in) * eps(float32) * (|x| @ |W|.T)`` (the decoded values are exact in float32;
  what remains is the float32 product's rounding);
- ``merged``: q/k/v rows cut from one tensor into a merged layer, stacked in order;
- ``sharded``: two tensor-parallel ranks (output rows of the merged layer, block-aligned input
  columns of the row-parallel one) whose results put together equal the whole;
- ``odd_rows``: output sizes that are no multiple of anything (7 rows);
- ``quantizer_bound`` (Q8_0, Q4_0, Q4_1): the reference's error against the float64 weights is within
  half a quantization step per block, so the encoded weights are what the format means.

Adopt it with::

    class TestMine(QuantizationSuite):
        implementation = "mine"
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from corerun.conformance.suite import Case, ConformanceSuite
from corerun.conformance.target import Target

QUANTIZER = ("Q8_0", "Q4_0", "Q4_1")  # gguf.quants.quantize implements these
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


def _gguf() -> Any:
    import gguf

    return gguf


def reference_blocks(type_name: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray | None]:
    """``(packed uint8 [rows, bytes], float64 weights or None)`` for ``type_name``."""
    from corerun.quantization.gguf_blocks import LAYOUTS

    gguf, rng = _gguf(), np.random.default_rng(seed)
    if type_name in QUANTIZER:
        w = rng.standard_normal((rows, cols)) * 0.05
        return gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType[type_name]), w
    layout = LAYOUTS[type_name]
    raw = rng.integers(0, 256, size=(rows, cols // layout.block_size * layout.type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, layout.type_size)
    halves = rng.uniform(-0.05, 0.05, size=(blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    at = (208,) if type_name == "Q6_K" else (0, 2)
    for i, offset in enumerate(at):
        blocks[:, offset : offset + 2] = halves[:, 2 * i : 2 * i + 2]
    return raw, None


def reference_weight(packed: np.ndarray, type_name: str) -> torch.Tensor:
    gguf = _gguf()
    return torch.from_numpy(gguf.quants.dequantize(packed, gguf.GGMLQuantizationType[type_name]).astype(np.float64))


def _packed(type_name: str, packed: np.ndarray, cols: int, name: str = "blk.0.attn_q.weight") -> Any:
    from corerun.quantization.gguf_tensor import GGUFTensor

    return GGUFTensor(name, type_name, torch.from_numpy(np.ascontiguousarray(packed)), cols)


def _check(what: str, got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = x.double() @ w.T
    bound = 8 * x.shape[1] ** 0.5 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.abs().T) + 1e-30
    excess = ((got.double() - want).abs() / bound).max().item()
    if excess > 1:
        worst = int(((got.double() - want).abs() / bound).argmax())
        raise AssertionError(
            f"{what}: output off the float64 dequantize-then-matmul by {excess:.3g}x the bound at flat index {worst} "
            f"(got {got.flatten()[worst].item():.6g}, expected {want.flatten()[worst].item():.6g})"
        )


class _OneRank:
    """A tensor-parallel group of one rank out of ``world_size``, whose collectives do nothing (the suite sums)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


class QuantizationSuite(ConformanceSuite):
    """The quantization method conformance suite (see the module docstring)."""

    kind = "quantization"

    def configs(self, check: str, target: Target, full: bool) -> list[tuple[str, Any]] | str:
        types = [t for t in BLOCK_TYPES if t in target.capabilities.gguf_types]
        if check.endswith("quantizer_bound"):
            types = [t for t in types if t in QUANTIZER]
        return [(t, t) for t in types] or f"{target.label} declares no GGUF block types"

    @staticmethod
    def _cols(type_name: str) -> int:
        return 512 if type_name.endswith("_K") else 96  # K types: two 256-blocks; others: three 32-blocks

    def _plain(self, case: Case, rows: int, tokens: int, seed: int) -> None:
        from corerun.models.layers import Linear

        self.start(case)
        t, cols = case.config, self._cols(case.config)
        packed, _ = reference_blocks(t, rows, cols, seed=seed)
        layer = Linear(cols, rows, quant=case.target.create())
        layer.weight.weight_loader(layer.weight, _packed(t, packed, cols))
        x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(seed + 1))
        with torch.no_grad():
            _check(f"{t} [{rows} x {cols}], {tokens} tokens", layer(x), x, reference_weight(packed, t))

    def test_matmul(self, case: Case) -> None:
        self._plain(case, rows=24, tokens=5, seed=1)

    def test_merged(self, case: Case) -> None:
        from corerun.models.layers import MergedLinear

        self.start(case)
        t, cols = case.config, self._cols(case.config)
        packed, _ = reference_blocks(t, 32, cols, seed=3)
        whole, w = _packed(t, packed, cols), reference_weight(packed, t)
        layer = MergedLinear(cols, {"q": 16, "k": 8, "v": 8}, quant=case.target.create())
        for shard, start in (("v", 24), ("q", 0), ("k", 16)):  # out of order on purpose
            layer.weight.weight_loader(layer.weight, whole.narrow(0, start, layer.shard_sizes[shard]), shard)
        x = torch.randn(3, cols, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            _check(f"{t} q/k/v merged", layer(x), x, w)

    def test_sharded(self, case: Case) -> None:
        from corerun.models.parallel_layers import ColumnParallelMergedLinear, RowParallelLinear

        self.start(case)
        t, cols = case.config, self._cols(case.config) * 2
        packed, _ = reference_blocks(t, 16, cols, seed=5)
        whole, w = _packed(t, packed, cols), reference_weight(packed, t)
        x = torch.randn(3, cols, generator=torch.Generator().manual_seed(6))
        columns, partial = [], torch.zeros(3, 16, dtype=torch.float64)
        for rank in (0, 1):
            col = ColumnParallelMergedLinear(cols, {"gate": (rank * 4, 4, 8), "up": (rank * 4, 4, 8)}, quant=case.target.create())
            col.weight.weight_loader(col.weight, whole.narrow(0, 0, 8), "gate")
            col.weight.weight_loader(col.weight, whole.narrow(0, 8, 8), "up")
            row = RowParallelLinear(cols, 16, False, _OneRank(rank, 2), case.target.create())  # type: ignore[arg-type]
            row.weight.weight_loader(row.weight, whole)
            with torch.no_grad():
                columns.append(col(x))
                partial += row(x[:, rank * cols // 2 : (rank + 1) * cols // 2]).double()
        gate = torch.cat([columns[0][:, :4], columns[1][:, :4]], 1)
        up = torch.cat([columns[0][:, 4:], columns[1][:, 4:]], 1)
        _check(f"{t} gate rows over 2 ranks", gate, x, w[:8])
        _check(f"{t} up rows over 2 ranks", up, x, w[8:])
        _check(f"{t} input columns over 2 ranks, summed", partial, x, w)

    def test_odd_rows(self, case: Case) -> None:
        self._plain(case, rows=7, tokens=1, seed=7)

    def test_quantizer_bound(self, case: Case) -> None:
        self.start(case)
        t = case.config
        packed, w = reference_blocks(t, 8, 256, seed=9)
        err = (reference_weight(packed, t) - torch.from_numpy(w)).abs().reshape(8, -1, 32)
        spread = torch.from_numpy(w).reshape(8, -1, 32)
        levels, top = {"Q8_0": (254, 127), "Q4_0": (16, 8), "Q4_1": (15, 15)}[t]  # steps over the width; largest code
        width = spread.abs().amax(-1, keepdim=True) * 2 if t != "Q4_1" else spread.amax(-1, keepdim=True) - spread.amin(-1, keepdim=True)
        step = width / levels
        # half a step, plus float16 rounding of the scale times the largest code
        half = 1.0 if t == "Q4_0" else 0.5  # Q4_0 codes -8..7 with d = max / -8: the opposite extreme clamps a whole step
        if (err > step * (half + top * 2**-11) + 1e-6 * width).any():
            raise AssertionError(f"{t}: the reference quantizer's error exceeds half a step somewhere")
