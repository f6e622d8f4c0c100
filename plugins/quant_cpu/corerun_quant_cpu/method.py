"""``gguf_cpu``: the built-in ``gguf`` method with its one-token and small-batch products in C++.

Storage and loading are ``gguf``'s (packed blocks, one buffer per shard).  ``apply`` on a CPU batch of
at most :data:`~corerun_quant_cpu.capabilities.KERNEL_MAX_TOKENS` rows in float32, bfloat16 or
float16 writes each Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K shard's columns of the output with the kernel
(:func:`corerun_quant_cpu.kernels.gguf_gemv`; the K types' 256-value super-blocks in ``csrc/gguf_k.cpp``), in float32 (a merged layer whose shards share one such
type in one call, its shards' rows moved into one buffer at load); a larger batch (prefill) has those shards
decoded by :func:`~corerun_quant_cpu.kernels.gguf_dequantize` and multiplied by torch; any other
shard is decoded in torch.  float64 and other devices take ``gguf``'s path unchanged.

The LM head too, when the file's tensor for it is one of those types (``output``, or ``token_embd``
for a tied head): :meth:`lm_head` gives the model a layer of this method holding those blocks, so the
logits go through the kernel instead of a float32 ``[vocab, hidden]`` product (the default model's
``token_embd`` is Q8_0: 30 MB read per token instead of 113 MB).  The embedding lookup keeps the
float rows the loader decoded.

Q8_0 on a CPU with AVX-512 + VNNI: at load the layer's blocks are also repacked
(:func:`~corerun_quant_cpu.kernels.repack_q8_0`: codes in the order the integer dot products sum them,
scales apart) and batches of every size multiply those (``gguf_cpu_q8_0``; prompts too: that product is ahead
of decode-then-matmul to 1024 tokens, :meth:`GGUFCpuMethod._any_size`); the blocks stay for ``gguf``'s own
paths, so such a layer holds its weight twice.  ``$CORERUN_QUANT_CPU_Q8_0_REPACK=0``
skips the repack (the product then reads the blocks, as on other CPUs).
"""

from __future__ import annotations

import os
from typing import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from corerun.sdk.models import Linear
from corerun.sdk.quantization import GGUFMethod, GGUFTensor

from corerun_quant_cpu import kernels
from corerun_quant_cpu.capabilities import GGUF_CPU, KERNEL_MAX_TOKENS, KERNEL_TYPES

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REPACK_ENV = "CORERUN_QUANT_CPU_Q8_0_REPACK"


class GGUFCpuMethod(GGUFMethod):
    name = "gguf_cpu"
    capabilities = GGUF_CPU
    quantizes_lm_head = True

    def __init__(self) -> None:
        reasons = kernels.load()
        if reasons:
            raise RuntimeError("quantization method gguf_cpu cannot run here: " + "; ".join(reasons))
        self.isa = kernels.chosen_isa()
        self.repack_q8_0 = self.isa == "avx512" and os.environ.get(REPACK_ENV, "1").strip() != "0"

    def lm_head(self, loaded: object) -> nn.Module | None:
        """A layer of this method holding the head's blocks, when they are a type the kernel reads."""
        if not isinstance(loaded, GGUFTensor) or loaded.type_name not in KERNEL_TYPES:
            return None
        layer = Linear(loaded.cols, loaded.shape[0], quant=self)
        layer.weight.weight_loader(layer.weight, loaded)
        return layer

    def load_weight(self, layer: nn.Module, loaded: object, shard_id: Hashable) -> None:
        """``gguf``'s load; once every shard is in and all are one type the kernel reads, the layer's
        blocks as one tensor (``gguf_cpu_whole``): a merged layer's rows (q/k/v, gate/up) moved into
        one buffer, each shard's buffer a view of it, so that :meth:`apply` makes one kernel call for
        the layer, quantizing the activations once."""
        super().load_weight(layer, loaded, shard_id)
        layer.gguf_cpu_whole = layer.gguf_cpu_q8_0 = None
        types = set(layer.gguf_types.values())
        if len(layer.gguf_types) < len(layer.gguf_shards) or len(types) != 1 or not types <= KERNEL_TYPES:
            return
        shards = self.shards(layer)
        if len(shards) > 1:
            merged = torch.cat([s.data for s in shards])
            at = 0
            for i, shard in enumerate(shards):
                setattr(layer, f"gguf_blocks_{i}", merged[at : at + shard.data.shape[0]])
                at += shard.data.shape[0]
            shards = [GGUFTensor("merged", types.pop(), merged, layer.gguf_in_features)]
        layer.gguf_cpu_whole = shards[0]
        if self.repack_q8_0 and shards[0].type_name == "Q8_0":
            layer.gguf_cpu_q8_0 = kernels.repack_q8_0(shards[0].data)

    def _gemv(self, layer: nn.Module, out: torch.Tensor, shard: GGUFTensor, x32: torch.Tensor) -> None:
        repacked = layer.__dict__.get("gguf_cpu_q8_0")
        if repacked is not None and self.isa == "avx512" and shard is layer.__dict__.get("gguf_cpu_whole"):
            kernels.gguf_gemv_q8_0_repacked(out, *repacked, x32)
        else:
            kernels.gguf_gemv(out, shard.data, x32, shard.type_name, self.isa)

    def _any_size(self, layer: nn.Module) -> bool:
        """The layer's Q8_0 blocks are repacked for AVX-512 + VNNI: that product is ahead of decode-then-matmul at
        every step size measured (0.41-0.65x its time from 16 to 192 tokens, 0.51-0.70x at 512, 0.69-0.84x at 1024;
        one thread, benchmarks/RESULTS.md "Twentieth session"), so prompts take it too."""
        return self.isa == "avx512" and layer.__dict__.get("gguf_cpu_q8_0") is not None

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        whole = layer.__dict__.get("gguf_cpu_whole")
        if (whole is not None and x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu"
                and (x.shape[0] <= KERNEL_MAX_TOKENS or self._any_size(layer))):
            out = torch.empty(x.shape[0], whole.data.shape[0], dtype=torch.float32)  # the decode step's path, kept short
            self._gemv(layer, out, whole, x.contiguous())
            return out
        if x.device.type != "cpu" or x.dim() != 2 or x.dtype not in _KERNEL_DTYPES:
            return super().apply(layer, x)
        shards = [whole] if whole is not None else self.shards(layer)
        if not any(s.type_name in KERNEL_TYPES for s in shards):
            return super().apply(layer, x)
        small = x.shape[0] <= KERNEL_MAX_TOKENS or self._any_size(layer)
        x32 = x.to(torch.float32).contiguous()
        out = torch.empty(x.shape[0], sum(s.data.shape[0] for s in shards), dtype=torch.float32)
        at = 0
        for shard in shards:
            rows = shard.data.shape[0]
            cols = out[:, at : at + rows]
            if shard.type_name in KERNEL_TYPES and small:
                self._gemv(layer, cols, shard, x32)
            elif shard.type_name in KERNEL_TYPES:  # prefill: decoded by the kernel, multiplied by torch
                w = torch.empty(rows, shard.cols, dtype=torch.float32)
                kernels.gguf_dequantize(w, shard.data, shard.type_name, self.isa)
                cols.copy_(F.linear(x32, w))
            else:
                cols.copy_(F.linear(x32, shard.dequantize(torch.float32)))
            at += rows
        return out if x.dtype == torch.float32 else out.to(x.dtype)
