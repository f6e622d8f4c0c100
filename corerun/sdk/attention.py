"""Attention-backend building blocks: the dense KV-cache layout, its KV write, and a base class.

A backend on the dense layout subclasses :class:`DenseAttentionBackend`, declares ``name`` and
``capabilities``, and writes ``attend``; the base class checks the spec (``UnsupportedError`` outside
the capabilities), allocates and views the cache, plans, and writes this step's K/V before calling
``attend`` with everything the step needs::

    class MyBackend(DenseAttentionBackend):
        name = "mine"
        capabilities = AttentionCapabilities(dtypes=frozenset({"float16"}), devices=frozenset({"cuda"}))

        def attend(self, query, k_cache, v_cache, plan, out):
            my_kernel(query, k_cache, v_cache, plan.batch.block_tables, plan.batch.seq_lens, out)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from corerun.platform.host import zeros_on_huge_pages
from corerun.plugin.capabilities import AttentionCapabilities
from corerun.protocols.attention import AttentionBatch, AttentionSpec
from corerun.sdk.checks import require_spec


def zeros_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed KV-cache tensor; in CPU memory on transparent huge pages where Linux allows them.

    A decode reads its requests' blocks scattered over the whole cache: on 4 KiB pages nearly every block
    misses the TLB (in a virtual machine a walk through two page tables); on 2 MiB pages the step's
    attention over 128 requests ran 11-13 % faster (docs/attention.md, "The cache on huge pages").
    """
    if torch.device(device).type == "cpu":
        return zeros_on_huge_pages(tuple(shape), dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


class DenseKVCache:
    """``kv_cache_bytes_per_block``, ``allocate_kv_cache``, ``kv_cache_view`` and ``write_kv`` for the
    dense layout: one tensor per layer, ``spec.kv_cache_shape(num_blocks)`` = ``[2, num_blocks,
    block_size, num_kv_heads, head_size]`` (K at 0, V at 1), allocated zeroed so that padding rows
    and unwritten slots never hold NaN.  A class mixing it in sets ``self.spec``."""

    name: ClassVar[str]
    spec: AttentionSpec

    def kv_cache_bytes_per_block(self) -> int:
        return self.spec.kv_bytes_per_block

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """Zeroed ``[2, num_blocks, block_size, num_kv_heads, head_size]`` at the spec's dtype and device."""
        s = self.spec
        return zeros_kv_cache(s.kv_cache_shape(num_blocks), s.dtype, s.device)

    def kv_cache_view(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)``, each ``[num_blocks, block_size, num_kv_heads, head_size]``; views into ``kv_cache``.

        Raises ``ValueError`` for a tensor of another layout.
        """
        s = self.spec
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[2:]) != (
            s.block_size, s.num_kv_heads, s.head_size,
        ):
            raise ValueError(
                f"{self.name} KV cache must have shape [2, num_blocks, {s.block_size}, {s.num_kv_heads}, {s.head_size}], "
                f"got {list(kv_cache.shape)}"
            )
        return kv_cache[0], kv_cache[1]

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        write_kv(key, value, kv_cache, slot_mapping)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_size]`` into a dense ``kv_cache`` ``[2, num_blocks,
    block_size, num_kv_heads, head_size]`` at ``slot_mapping`` ``[T]`` (``block * block_size + offset``);
    slot ``-1`` writes nothing.  No host sync, so it may run inside a captured CUDA graph: a padding
    row rewrites the first real row's slot with that row's own value (or, when no row is real, slot 0
    with what it already holds)."""
    num_tokens = slot_mapping.shape[0]
    if key.shape[0] != num_tokens or value.shape[0] != num_tokens:
        raise ValueError(
            f"write_kv: key {tuple(key.shape)} and value {tuple(value.shape)} need one row per slot_mapping entry ({num_tokens})"
        )
    if num_tokens == 0:
        return
    _, nb, bs, h, d = kv_cache.shape
    flat = kv_cache.view(2, nb * bs, h, d)
    slots = slot_mapping.long()
    real = slots >= 0
    first = real.to(torch.int32).argmax().view(1)  # first real row (0 when none is)
    rows = torch.where(real, torch.arange(num_tokens, device=slots.device), first)
    target = torch.where(real, slots, slots.index_select(0, first).clamp(min=0))
    any_real = real.index_select(0, first).view(1, 1, 1)
    for i, src in enumerate((key, value)):
        new = torch.where(any_real, src.index_select(0, rows).to(flat.dtype), flat[i].index_select(0, target))
        flat[i].index_copy_(0, target, new)


@dataclass
class AttentionPlan:
    """What ``plan`` hands ``attend``: the step's :class:`AttentionBatch` (slot mapping, block tables,
    lengths) and whatever the backend's ``prepare`` derived from it (``None`` by default)."""

    batch: AttentionBatch
    data: Any = None


class DenseAttentionBackend(DenseKVCache):
    """A complete ``AttentionBackend`` but for ``attend``.  Built as ``factory(spec, **options)``."""

    name: ClassVar[str] = "unnamed"
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities()

    def __init__(self, spec: AttentionSpec) -> None:
        require_spec(f"attention backend '{self.name}'", self.capabilities, spec)
        self.spec = spec

    def prepare(self, batch: AttentionBatch) -> Any:
        """Per-step data for ``attend`` (split sizes, scheduler metadata...), once per step.  With
        ``cuda_graph_decode`` it may only reference ``batch``'s tensors and host values fixed by shapes."""
        return None

    def plan(self, batch: AttentionBatch) -> AttentionPlan:
        return AttentionPlan(batch, self.prepare(batch))

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        metadata: AttentionPlan, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.write_kv(key, value, kv_cache, metadata.batch.slot_mapping)
        if out is None:
            out = torch.empty_like(query)
        k_cache, v_cache = self.kv_cache_view(kv_cache)
        self.attend(query, k_cache, v_cache, metadata, out)
        return out

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan, out: torch.Tensor) -> None:
        """Write into ``out`` ``[T, num_heads, head_size]`` the attention of ``query`` (same shape) over
        the paged cache ``k_cache``/``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_size]``,
        which already holds this step's K/V.  ``plan.batch`` describes the step."""
        raise NotImplementedError(f"{type(self).__name__} must implement attend()")


def reference_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch, scale: float,
    out: torch.Tensor,
) -> None:
    """Paged causal attention in plain torch, one request at a time (float32 math, float64 for float64):
    a correct starting point to replace with a kernel.  Reads the host copies of the lengths, so it is
    not CUDA-graph safe (declare ``cuda_graph_decode=False``)."""
    qsl = (batch.query_start_loc_cpu if batch.query_start_loc_cpu is not None else batch.query_start_loc).tolist()
    lens = (batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens).tolist()
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    for i in range(batch.num_reqs):
        start, end, seq_len = qsl[i], qsl[i + 1], lens[i]
        if end == start:
            continue
        blocks = batch.block_tables[i, : math.ceil(seq_len / block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:seq_len].to(compute)  # [S, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[:seq_len].to(compute)
        q = query[start:end].to(compute)  # [L, Hq, D]
        group = q.shape[1] // num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,shd->hls", q, k) * scale
        q_pos = seq_len - (end - start) + torch.arange(end - start, device=q.device)
        causal = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [L, S]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hls,shd->lhd", probs, v).to(out.dtype)


__all__ = ["AttentionPlan", "DenseAttentionBackend", "DenseKVCache", "reference_attention", "write_kv"]
