"""The quantization method conformance suite: a method's layers against float64 dequantize-then-matmul.

For every GGUF block type the method declares (``capabilities.gguf_types``), a weight is encoded by
an independent reference: random float64 weights quantized by the ``gguf`` package's own quantizer
(``gguf.quants.quantize``; Q8_0, Q4_0, Q4_1), or, for the K types it has no quantizer for, random
codes with random float16 scales; ``gguf.quants.dequantize`` (numpy) decodes them into the
reference weight ``W``.  For every ``quant_method`` it declares (``gptq``, ``awq``,
``compressed-tensors``, ``fp8``), each format of :mod:`corerun.conformance.reference.quantizers`
writes one layer's checkpoint tensors and ``quantization_config`` from random float64 weights and
decodes its own codes into ``W``; the method reads them through its ``checkpoint_weights``.  A W8A8
format's layers quantize their activations per token, so their bound adds half an activation step
times ``|W|``'s row sums; so does a method declaring ``int8_activations`` (per token or per smaller
group, whose step is no larger than the token's).  Checks, each through corerun's own layers:

- ``matmul``: a plain linear layer's output for float32 activations against ``x @ W.T`` in float64,
  within ``8 * sqrt(in) * eps(float32) * (|x| @ |W|.T)`` (the decoded values are exact in float32;
  what remains is the float32 product's rounding);
- ``merged``: q/k/v rows cut from one tensor into a merged layer, stacked in order;
- ``sharded``: two tensor-parallel ranks (output rows of the merged layer, block-aligned input
  columns of the row-parallel one) whose results put together equal the whole;
- ``odd_rows``: output sizes that are no multiple of anything (7 rows; input features off the
  group and word boundaries where the format allows them);
- ``quantizer_bound`` (Q8_0, Q4_0, Q4_1 and every quant_method format): the reference's error against
  the float64 weights is within half a quantization step per block, so the encoded weights are what
  the format means.

Adopt it with::

    class TestMine(QuantizationSuite):
        implementation = "mine"
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from corerun.conformance.reference.quantizers import FORMATS
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


def _check(what: str, got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, act_step: bool = False) -> None:
    """``got`` against ``x @ w.T`` in float64; ``act_step``: ``x`` is quantized per token to int8 by the layer."""
    want = x.double() @ w.T
    bound = 8 * x.shape[1] ** 0.5 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.abs().T) + 1e-30
    if act_step:  # each activation within half its row's step, max|x_t| / 127
        bound = bound + (x.double().abs().amax(1, keepdim=True) / 127 / 2) * w.abs().sum(1)[None, :]
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
        caps = target.capabilities
        types = [t for t in BLOCK_TYPES if t in caps.gguf_types]
        formats = [f for f in FORMATS.values() if f.quant_method in caps.quant_methods]
        if check.endswith("quantizer_bound"):
            types = [t for t in types if t in QUANTIZER]
        if check.endswith("odd_rows"):
            formats = [f for f in formats if not isinstance(f.odd, str)]
        cases = [(t, t) for t in types] + [(f.name, f.name) for f in formats]
        return cases or f"{target.label} declares no GGUF block types and no quant_method the suite has a reference for"

    @staticmethod
    def _cols(type_name: str) -> int:
        return 512 if type_name.endswith("_K") else 96  # K types: two 256-blocks; others: three 32-blocks

    def _reference(self, case: Case, rows: int, cols: int, seed: int) -> tuple[Any, torch.Tensor, bool]:
        """``(packed whole weight as the method reads it, float64 W, activations quantized per token)``."""
        name = case.config
        if name not in FORMATS:
            packed, _ = reference_blocks(name, rows, cols, seed=seed)
            return _packed(name, packed, cols), reference_weight(packed, name), case.target.capabilities.int8_activations
        ref = FORMATS[name].make(rows, cols, seed)
        prefix = "model.layers.0.self_attn.q_proj"
        out = list(case.target.create().checkpoint_weights(((f"{prefix}.{k}", t) for k, t in ref.tensors.items()), ref.config))
        if len(out) != 1 or out[0][0] != f"{prefix}.weight":
            raise AssertionError(
                f"{name}: checkpoint_weights turned the parts {sorted(ref.tensors)} of {prefix} into {[n for n, _ in out]}; "
                f"expected one packed tensor named {prefix}.weight"
            )
        return out[0][1], ref.weight, ref.act_step or case.target.capabilities.int8_activations

    def _plain(self, case: Case, rows: int, tokens: int, seed: int, cols: int | None = None) -> None:
        from corerun.models.layers import Linear

        self.start(case)
        t, cols = case.config, cols or self._cols(case.config)
        whole, w, act = self._reference(case, rows, cols, seed)
        layer = Linear(cols, rows, quant=case.target.create())
        layer.weight.weight_loader(layer.weight, whole)
        x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(seed + 1))
        with torch.no_grad():
            _check(f"{t} [{rows} x {cols}], {tokens} tokens", layer(x), x, w, act)

    def test_matmul(self, case: Case) -> None:
        self._plain(case, rows=24, tokens=5, seed=1)

    def test_merged(self, case: Case) -> None:
        from corerun.models.layers import MergedLinear

        self.start(case)
        t, cols = case.config, self._cols(case.config)
        whole, w, act = self._reference(case, 32, cols, seed=3)
        layer = MergedLinear(cols, {"q": 16, "k": 8, "v": 8}, quant=case.target.create())
        for shard, start in (("v", 24), ("q", 0), ("k", 16)):  # out of order on purpose
            layer.weight.weight_loader(layer.weight, whole.narrow(0, start, layer.shard_sizes[shard]), shard)
        x = torch.randn(3, cols, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            _check(f"{t} q/k/v merged", layer(x), x, w, act)

    def test_sharded(self, case: Case) -> None:
        from corerun.models.parallel_layers import ColumnParallelMergedLinear, RowParallelLinear

        self.start(case)
        t, cols = case.config, self._cols(case.config) * 2
        whole, w, act = self._reference(case, 32, cols, seed=5)  # gate rows 0-15, up rows 16-31; 8 per rank
        x = torch.randn(3, cols, generator=torch.Generator().manual_seed(6))
        columns, partial = [], torch.zeros(3, 32, dtype=torch.float64)
        for rank in (0, 1):
            col = ColumnParallelMergedLinear(cols, {"gate": (rank * 8, 8, 16), "up": (rank * 8, 8, 16)}, quant=case.target.create())
            col.weight.weight_loader(col.weight, whole.narrow(0, 0, 16), "gate")
            col.weight.weight_loader(col.weight, whole.narrow(0, 16, 16), "up")
            row = RowParallelLinear(cols, 32, False, _OneRank(rank, 2), case.target.create())  # type: ignore[arg-type]
            row.weight.weight_loader(row.weight, whole)
            with torch.no_grad():
                columns.append(col(x))
                partial += row(x[:, rank * cols // 2 : (rank + 1) * cols // 2]).double()
        gate = torch.cat([columns[0][:, :8], columns[1][:, :8]], 1)
        up = torch.cat([columns[0][:, 8:], columns[1][:, 8:]], 1)
        _check(f"{t} gate rows over 2 ranks", gate, x, w[:16], act)
        _check(f"{t} up rows over 2 ranks", up, x, w[16:], act)
        # W8A8: each rank quantizes its own half of x, a step no larger than the whole row's: the same bound
        _check(f"{t} input columns over 2 ranks, summed", partial, x, w, act)

    def test_odd_rows(self, case: Case) -> None:
        if case.config in FORMATS:
            rows, cols = FORMATS[case.config].odd  # type: ignore[misc]
            self._plain(case, rows=rows, tokens=1, seed=7, cols=cols)
        else:
            self._plain(case, rows=7, tokens=1, seed=7)

    def test_quantizer_bound(self, case: Case) -> None:
        self.start(case)
        t = case.config
        if t in FORMATS:
            ref = FORMATS[t].make(8, 96, 9)
            err = (ref.weight - ref.original).abs()
            if (err > ref.bound).any():
                worst = int((err / ref.bound).argmax())
                raise AssertionError(f"{t}: the reference quantizer's error {err.flatten()[worst]:.3g} exceeds the format's bound {ref.bound.flatten()[worst]:.3g}")
            return
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
