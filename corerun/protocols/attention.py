"""The ``AttentionBackend`` protocol.

A backend owns three things: the layout of its KV-cache tensor, the per-batch metadata it derives
from an :class:`AttentionBatch` (``plan``, once per step), and the per-layer call (``forward``, once
per layer per step) that writes the new K/V into the cache by slot mapping and attends.

Batches mix prefill chunks and decodes freely.  Requests are laid out back to back in the flat token
dimension; request ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i+1]``.  Its first
``context_lens[i]`` tokens are already in the cache (a cached prefix, an earlier prefill chunk, or
the tokens decoded so far); this step adds ``query_lens[i] = seq_lens[i] - context_lens[i]`` more.
Query token ``j`` of request ``i`` sits at position ``context_lens[i] + j`` and attends causally to
positions ``0 .. context_lens[i] + j`` of its own sequence, all read from the paged cache after this
step's K/V were written.  A decode is simply a request with ``query_lens[i] == 1``.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from corerun.plugin.capabilities import AttentionCapabilities

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


# ``kv_cache.dtype`` values other than ``auto`` (K/V stored in the model's dtype) -> the element type the
# cache stores.  fp8: one float scale per tensor (``AttentionSpec.kv_scales``); int8: a float16 scale per
# token and KV head, stored after the head's values (docs/kv-cache.md, "Quantized KV cache").
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
INT8_SCALE_BYTES = 2  # the float16 scale that follows each token-head's int8 values


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class AttentionSpec:
    """What a model asks of its attention layers (per tensor-parallel rank)."""

    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads; num_heads % num_kv_heads == 0
    head_size: int
    dtype: torch.dtype  # dtype of q/k/v and of the KV cache
    block_size: int  # tokens per KV-cache block
    device: torch.device
    scale: float | None = None  # softmax scale; None means head_size ** -0.5
    # per layer: the window of a sliding-window layer (query at position p attends to keys p - window + 1 .. p),
    # None for a full (causal) layer; () when every layer is full.  Needs capabilities.sliding_window.
    sliding_windows: tuple[int | None, ...] = ()
    # every layer's scaled scores become ``cap * tanh(score / cap)`` before the softmax (Gemma 2); None: none.
    # Needs capabilities.logits_soft_cap.
    logits_soft_cap: float | None = None
    # how the cache stores K and V: "auto" (in ``dtype``) or a key of KV_CACHE_DTYPES.  Needs the backend's
    # capabilities.kv_cache_dtypes.  kv_scales: fp8's (k_scale, v_scale): stored = value / scale.
    kv_cache_dtype: str = "auto"
    kv_scales: tuple[float, float] = (1.0, 1.0)

    def sliding_window(self, layer: int) -> int | None:
        """Layer ``layer``'s window, or ``None`` for full attention."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def per_layer(self) -> bool:
        """Some layer attends through a sliding window: ``forward`` is then told which layer it runs."""
        return any(w is not None for w in self.sliding_windows)

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_size**-0.5

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """The usual dense layout of one layer's cache: ``(2, num_blocks, block_size, num_kv_heads,
        head_size)``, K at index 0 and V at 1 (what the bundled backends allocate)."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block's K and V in one layer in :meth:`kv_cache_shape`'s layout at ``dtype``, or at
        ``kv_cache_dtype`` (int8: plus each token-head's float16 scale); the usual ``kv_cache_bytes_per_block``
        of a backend whose layout has no padding."""
        if self.kv_cache_dtype == "auto":
            return math.prod(self.kv_cache_shape(1)) * self.dtype.itemsize
        extra = INT8_SCALE_BYTES if self.kv_cache_dtype == "int8" else 0
        return 2 * self.block_size * self.num_kv_heads * (self.head_size + extra)


@dataclass
class AttentionBatch:
    """Backend-independent description of one step's batch, built by the ModelRunner.

    Device tensors (on ``spec.device``):

    - ``query_start_loc``  int32 ``[num_reqs + 1]``: cumulative query lengths (``cu_seqlens_q``).
    - ``seq_lens``         int32 ``[num_reqs]``: tokens in each sequence after this step.
    - ``context_lens``     int32 ``[num_reqs]``: tokens already in the cache before this step.
    - ``block_tables``     int32 ``[num_reqs, max_blocks_per_seq]``: physical block ids; entries past
      ``ceil(seq_lens[i] / block_size)`` are padding (any valid id, usually 0) and must not be read.
    - ``slot_mapping``     int64 ``[num_tokens]``: cache slot (``block * block_size + offset``) of each
      new token's K/V; ``-1`` marks a padding token whose K/V must not be written anywhere.

    Host values, known without a device sync: ``num_reqs``, ``num_tokens``, ``max_query_len``,
    ``max_seq_len`` (an upper bound; a CUDA-graph capture passes ``max_model_len``), ``num_decodes``
    (the first ``num_decodes`` requests have ``query_len == 1``; the runner orders decodes first),
    and ``query_start_loc_cpu`` / ``seq_lens_cpu`` (may be ``None`` inside a CUDA graph, where they
    would go stale).  Rows a CUDA-graph bucket adds as padding are decodes with ``seq_lens == 1``,
    ``context_lens == 0`` and slot ``-1``: they write nothing, and their output rows are discarded.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int = 0
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None

    @property
    def is_pure_decode(self) -> bool:
        return self.num_decodes == self.num_reqs

    @property
    def query_lens(self) -> torch.Tensor:
        return self.seq_lens - self.context_lens


@runtime_checkable
class AttentionBackend(Protocol):
    """One attention implementation, built once per model by its registered factory.

    Factory signature: ``factory(spec: AttentionSpec, **options) -> AttentionBackend``.  The factory
    raises :class:`corerun.errors.UnsupportedError` for a spec outside ``capabilities``.
    """

    name: ClassVar[str]
    capabilities: ClassVar[AttentionCapabilities]
    spec: AttentionSpec

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one block occupies in one layer's cache (K and V together)."""
        ...

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """Allocate one layer's cache, in this backend's own layout."""
        ...

    def kv_cache_view(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(k, v)`` of a cache in the canonical layout ``[num_blocks, block_size, num_kv_heads, head_size]``.

        Used by tests and tools, never on the hot path.  Writes through the views land in the cache.
        """
        ...

    def plan(self, batch: AttentionBatch) -> Any:
        """Derive this backend's per-step metadata from ``batch`` (once per step, outside any CUDA graph).

        When ``capabilities.cuda_graph_decode`` is true, the plan of a pure-decode batch may only
        reference ``batch``'s tensors (no copies) and decide from host values that depend on shapes
        alone, so that replaying a graph captured with one plan stays valid after the runner writes
        new values into the same tensors.

        The batch's tensors are the step's own: a later step may write new values into the same
        memory (on CPU the runner reuses a step's host tensors once no Python object refers to them).
        A backend that keeps anything past the step keeps a copy, never the tensors themselves, and
        never as a reference held only in native code, which the runner cannot see.
        """
        ...

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into ``kv_cache`` at ``slot_mapping``; skip ``-1``."""
        ...

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        out: torch.Tensor | None = None,
        *,
        layer: int = 0,
    ) -> torch.Tensor:
        """One layer: write the new K/V into ``kv_cache``, then attend.

        ``query`` ``[num_tokens, num_heads, head_size]``; ``key``/``value``
        ``[num_tokens, num_kv_heads, head_size]``; returns ``[num_tokens, num_heads, head_size]``
        (into ``out`` when given), every row of real tokens written.

        ``layer``: the layer's index, passed only when ``spec.per_layer`` (a backend declaring
        ``sliding_window`` reads the layer's window as ``spec.sliding_window(layer)``); a backend that
        declares no sliding windows is never built for such a spec and may leave the argument out.
        """
        ...
