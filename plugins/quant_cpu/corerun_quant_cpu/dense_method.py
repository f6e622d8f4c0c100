"""``dense_cpu``: unquantized weights, as the built-in ``none`` loads them, multiplied on CPU by C++ for decode steps.

A decode step of one request is a matrix-vector product that streams every weight once; oneDNN's
bfloat16 and float32 products stream them well below what a core reads, and its float32 one-token product
gains nothing from a second thread (benchmarks/RESULTS.md).  This method loads a dense checkpoint exactly as
``none`` does (one ``[out, in]`` weight per layer, a merged layer's q/k/v or gate/up shards stacked in
order, a tensor-parallel rank's slice as the layer cut it) and, once the layer's last shard is in, keeps
two copies made from it in place of the plain weight:

- in a bfloat16 model, ``bf16_packed``: :func:`~corerun_quant_cpu.kernels.repack_bf16`'s layout (16 rows by
  2 columns per 64-byte vector, which is also AMX's tile layout), read by
  :func:`~corerun_quant_cpu.kernels.bf16_gemv` for batches of up to
  :data:`~corerun_quant_cpu.capabilities.BF16_MAX_TOKENS` rows, or
  :data:`~corerun_quant_cpu.capabilities.BF16_AMX_MAX_TOKENS` where the CPU has AMX (a decode step of
  up to 64 requests streams the weights once through AMX tiles, against oneDNN's 1.3x time at 32);
- in a float32 model, ``f32_packed``: :func:`~corerun_quant_cpu.kernels.repack_f32`'s layout (16 rows of
  one column per 64-byte vector), read by :func:`~corerun_quant_cpu.kernels.f32_gemv` for batches of up to
  :data:`~corerun_quant_cpu.capabilities.F32_MAX_TOKENS` rows;
- ``dense_onednn``: oneDNN's prepacked copy, the one ``none``'s layers make (AMX where the CPU has it),
  for larger batches (prefill).

The plain weight is then emptied (``layer.weight`` holds no values): the layer holds two copies, as a
``none`` layer does (its weight plus oneDNN's).  Where the weight is neither (float16, another device, a
CPU without AVX-512 for float32) nothing is repacked and :meth:`apply` is ``none``'s.

The LM head too (:meth:`lm_head`): a layer of this method in the model's dtype made from the checkpoint's
head tensor (the tied embedding's, for the default model: 49152 x 576, a fifth of the bytes a step reads).
The embedding keeps its own float rows for the lookup, so a tied head adds one copy over ``none``'s two.

A subclass of the built-in ``none`` (:class:`corerun.sdk.quantization.DenseMethod`): its storage and
loading, with the repack added after a layer's last shard.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping

import torch
from torch import nn

from corerun.sdk.models import Linear
from corerun.sdk.quantization import DenseMethod

from corerun_quant_cpu import kernels
from corerun_quant_cpu.capabilities import BF16_AMX_MAX_TOKENS, BF16_MAX_TOKENS, DENSE_CPU, F32_MAX_TOKENS


def _onednn_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class DenseCpuMethod(DenseMethod):
    name = "dense_cpu"
    capabilities = DENSE_CPU
    dense = False  # the layers hand their weight to this method (checkpoints it reads are dense: capabilities.dense)
    quantizes_lm_head = True

    def __init__(self) -> None:
        reasons = kernels.load()
        if reasons:
            raise RuntimeError("quantization method dense_cpu cannot run here: " + "; ".join(reasons))
        self.isa = kernels.bf16_best_isa()
        self.max_tokens = BF16_AMX_MAX_TOKENS if self.isa == "amx" else BF16_MAX_TOKENS  # rows bf16_gemv takes
        self.f32_isa = kernels.f32_best_isa()
        self.model_dtype: torch.dtype | None = None  # the default dtype the layers were made in (the model's)

    @property
    def parallel_tokens(self) -> int | None:  # type: ignore[override]
        """1 in a float32 model with the AVX-512 kernel: it splits even one token's rows over the threads (the
        default model's 538 MB, one token: 16.5 ms on two threads against 21.7 on one, as fast as the memory
        serves them; oneDNN's 23.5 / 38.0).  Else ``None``: the dtype's rule (bfloat16 without AMX already runs
        every step on every thread)."""
        return 1 if self.model_dtype == torch.float32 and self.repacks(torch.float32) else None

    def repacks(self, dtype: torch.dtype) -> bool:
        """Whether a CPU weight of ``dtype`` gets this method's kernel here: bfloat16 where oneDNN multiplies
        bfloat16 (its copy takes the large batches), float32 where the CPU has AVX-512."""
        if not torch.backends.mkldnn.is_available():
            return False
        return (dtype == torch.bfloat16 and _onednn_bf16()) or (dtype == torch.float32 and self.f32_isa == "avx512")

    def create_weights(self, layer: nn.Module, in_features: int, shard_sizes: Mapping[Hashable, int]) -> None:
        """``none``'s ``layer.weight`` ``[sum of shard_sizes, in_features]`` in the default dtype (the model's)."""
        super().create_weights(layer, in_features, shard_sizes)
        self.model_dtype = torch.get_default_dtype()
        layer.dense_rows = layer.weight.shape[0]  # (kept: the weight is emptied once repacked)
        layer.dense_loaded = set()
        layer.bf16_packed = layer.f32_packed = layer.dense_onednn = None

    def load_weight(self, layer: nn.Module, loaded: Any, shard_id: Hashable) -> None:
        """Copy ``loaded`` (a float tensor) into its shard's rows; after the layer's last shard, repack."""
        if not isinstance(loaded, torch.Tensor):
            raise TypeError(f"dense_cpu reads unquantized checkpoints; got a {type(loaded).__name__} for shard {shard_id!r}")
        if layer.weight.numel() == 0:
            raise RuntimeError(f"dense_cpu: shard {shard_id!r} loaded again after the layer was repacked (its plain weight is gone)")
        super().load_weight(layer, loaded, shard_id)
        layer.dense_loaded.add(shard_id)
        if len(layer.dense_loaded) == len(layer.dense_sizes):
            self._repack(layer)

    def _repack(self, layer: nn.Module) -> None:
        w = layer.weight.data
        if w.device.type != "cpu" or not self.repacks(w.dtype):
            return
        if w.dtype == torch.bfloat16:
            layer.bf16_packed = kernels.repack_bf16(w)
        else:
            layer.f32_packed = kernels.repack_f32(w)
        with torch.inference_mode():  # made outside it, the same reorder multiplied 10% slower at 16 tokens (RESULTS.md)
            layer.dense_onednn = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
        layer.weight.data = w.new_empty(0)  # both copies above hold it

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in]`` -> ``[T, out]`` in ``x``'s dtype (the model's: bfloat16 or float32)."""
        onednn = layer.__dict__.get("dense_onednn")
        if onednn is None:
            return super().apply(layer, x)
        few = x.dim() == 2 and x.device.type == "cpu"
        packed = layer.bf16_packed
        if packed is not None:
            if few and x.dtype == torch.bfloat16 and x.shape[0] <= self.max_tokens:
                out = torch.empty(x.shape[0], layer.dense_rows, dtype=torch.bfloat16)
                kernels.bf16_gemv(out, packed, x.contiguous(), self.isa)
                return out
            y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), onednn, None, "none", [], "")
            return y if x.dtype == torch.bfloat16 else y.to(x.dtype)
        if few and x.dtype == torch.float32 and x.shape[0] <= F32_MAX_TOKENS:
            out = torch.empty(x.shape[0], layer.dense_rows, dtype=torch.float32)
            kernels.f32_gemv(out, layer.f32_packed, x.contiguous(), self.f32_isa)
            return out
        y = torch.ops.mkldnn._linear_pointwise(x.to(torch.float32), onednn, None, "none", [], "")
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def lm_head(self, loaded: Any) -> nn.Module | None:
        """A layer of this method holding the head ``loaded`` ``[vocab, hidden]`` (a float tensor), in the model's
        dtype (the one its layers were made in; bfloat16 when none were) where this method repacks that dtype."""
        dtype = self.model_dtype or torch.bfloat16
        if not isinstance(loaded, torch.Tensor) or loaded.dim() != 2 or not self.repacks(dtype):
            return None
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # called after the model's load, outside its default dtype
        try:
            layer = Linear(loaded.shape[1], loaded.shape[0], quant=self)
        finally:
            torch.set_default_dtype(previous)
        layer.weight.weight_loader(layer.weight, loaded)
        return layer
