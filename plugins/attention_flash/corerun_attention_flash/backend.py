"""``FlashAttentionBackend``: corerun's ``AttentionBackend`` over flash-attn (FA2 ``flash_attn`` or FA3 ``flash_attn_interface``).

KV cache, one tensor per layer: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` in the
model's dtype, K at index 0 and V at index 1: ``kv_cache[0]`` and ``kv_cache[1]`` are exactly the
paged ``k_cache`` / ``v_cache`` flash-attn reads (``[num_blocks, page_block_size, nheads_k, headdim]``,
contiguous), and also corerun's canonical view.

Construction refuses, with :class:`~corerun.errors.UnsupportedError` naming every reason, any spec
this backend did not declare *and* anything the installed flash-attn cannot serve (FA2 with a block
size that is not a multiple of 256, a flash-attn too old to read a paged cache, a GPU older than
Ampere), then runs one tiny call of each entry point on a two-block cache, so that a build that
rejects this head size, dtype or GPU fails at startup with flash-attn's own message, not mid-step.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar

import torch

from corerun.sdk import AttentionCapabilities
from corerun.errors import UnsupportedError
from corerun.protocols.attention import AttentionBatch, AttentionSpec, dtype_name
from corerun.sdk.attention import DenseKVCache
from corerun_attention_flash import emulation
from corerun_attention_flash.capabilities import FLASH_CAPABILITIES
from corerun_attention_flash.kernels import FlashKernels, device_reasons, installed_limit_reasons, load_kernels
from corerun_attention_flash.kv_write import write_kv_by_slot
from corerun_attention_flash.metadata import FlashDecodeMetadata, FlashMetadata, FlashVarlenMetadata, plan_batch

logger = logging.getLogger("corerun_attention_flash")

IMPLEMENTATION = "attention backend 'flash'"


class FlashAttentionBackend(DenseKVCache):
    """flash-attn over corerun's paged KV cache.  Factory: ``FlashAttentionBackend(spec)``."""

    name: ClassVar[str] = "flash"
    capabilities: ClassVar[AttentionCapabilities] = FLASH_CAPABILITIES

    def __init__(self, spec: AttentionSpec) -> None:
        device = torch.device(spec.device)
        reasons = self._capabilities_here().check(spec) + device_reasons(device)
        kernels, library_reasons = load_kernels(device)
        reasons += library_reasons
        if kernels is not None:
            reasons += installed_limit_reasons(kernels, spec)
        if reasons or kernels is None:  # no kernels always comes with its reasons
            raise UnsupportedError(IMPLEMENTATION, reasons)
        self.spec = spec
        self.kernels: FlashKernels = kernels
        self.library = kernels.library
        self.scale = spec.softmax_scale
        self._self_check()
        logger.info(
            "flash attention: %s, %s, %d/%d heads of size %d, block size %d",
            self.library, dtype_name(spec.dtype), spec.num_heads, spec.num_kv_heads, spec.head_size, spec.block_size,
        )

    @classmethod
    def _capabilities_here(cls) -> AttentionCapabilities:
        emulated = emulation.current()
        if emulated is None:
            return cls.capabilities
        caps = cls.capabilities
        return dataclasses.replace(caps, devices=caps.devices | {"cpu"}, dtypes=caps.dtypes | emulated.extra_dtypes)

    # ---------------------------------------------------------------- per step
    def plan(self, batch: AttentionBatch) -> FlashMetadata:
        return plan_batch(batch)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv_by_slot(key, value, kv_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V, then attend over the paged cache.

        ``query`` ``[num_tokens, num_heads, head_size]``, ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]``
        -> ``[num_tokens, num_heads, head_size]`` (into ``out`` when given).
        """
        write_kv_by_slot(key, value, kv_cache, metadata.slot_mapping)
        if query.shape[0] == 0:
            return out if out is not None else torch.empty_like(query)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if isinstance(metadata, FlashDecodeMetadata):
            result = self.kernels.decode(query.unsqueeze(1), k_cache, v_cache, metadata, self.scale)
            result = result.reshape(query.shape)
        else:
            result = self.kernels.varlen(query, k_cache, v_cache, metadata, self.scale)
        if out is None:
            return result
        out.copy_(result)
        return out

    # ----------------------------------------------------------- construction
    def _self_check(self) -> None:
        """One tiny call of each entry point on a two-block cache; a refusal becomes an UnsupportedError now."""
        s = self.spec
        dev = s.device
        cache = self.allocate_kv_cache(2)
        q = torch.zeros(2, s.num_heads, s.head_size, dtype=s.dtype, device=dev)
        block_table = torch.tensor([[0, 1]], dtype=torch.int32, device=dev)
        two = torch.tensor([2], dtype=torch.int32, device=dev)
        cu = torch.tensor([0, 2], dtype=torch.int32, device=dev)
        slots = torch.full((2,), -1, dtype=torch.int64, device=dev)
        varlen = FlashVarlenMetadata(cu, cu, two, block_table, slots, max_seqlen_q=2, max_seqlen_k=2, num_reqs=1)
        decode = FlashDecodeMetadata(two, block_table, slots[:1], num_reqs=1)
        try:
            self.kernels.varlen(q, cache[0], cache[1], varlen, self.scale)
            self.kernels.decode(q[:1].unsqueeze(1), cache[0], cache[1], decode, self.scale)
        except Exception as exc:
            raise UnsupportedError(
                IMPLEMENTATION,
                f"{self.library} refused a {dtype_name(s.dtype)} paged cache of block size {s.block_size} with "
                f"{s.num_heads}/{s.num_kv_heads} heads of size {s.head_size} on {dev}: {type(exc).__name__}: {exc}",
            ) from exc
