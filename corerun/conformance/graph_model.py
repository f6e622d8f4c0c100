"""A tiny deterministic model for the graph-runner suite: embedding + one attention layer + linear.

``model(input_ids, positions, attn_metadata) -> hidden`` is the :data:`corerun.protocols.graph.ModelFn`
signature; attention goes through a real attention backend (the built-in ``torch`` one by default),
so the runner's handling of the backend's plan and static buffers is exercised for real.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from corerun.protocols.attention import AttentionSpec


class TinyModel:
    """Weights drawn from a fixed seed; ``kv_cache`` is the single layer's cache (backend layout)."""

    def __init__(self, attention: Any, spec: AttentionSpec, vocab_size: int, hidden_size: int, num_blocks: int, seed: int = 7) -> None:
        gen = torch.Generator().manual_seed(seed)
        dt, dev = spec.dtype, spec.device
        self.attention, self.spec, self.hidden_size = attention, spec, hidden_size
        hq, hkv = spec.num_heads * spec.head_size, spec.num_kv_heads * spec.head_size

        def w(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dt).to(dev)

        self.embed = w(vocab_size, hidden_size, scale=1.0)
        self.wq = w(hidden_size, hq, scale=1 / math.sqrt(hidden_size))
        self.wk = w(hidden_size, hkv, scale=1 / math.sqrt(hidden_size))
        self.wv = w(hidden_size, hkv, scale=1 / math.sqrt(hidden_size))
        self.wo = w(hq, hidden_size, scale=1 / math.sqrt(hq))
        self.freqs = (1.0 / (100.0 ** (torch.arange(hidden_size, dtype=torch.float64) / hidden_size))).to(dev)
        self.kv_cache = attention.allocate_kv_cache(num_blocks)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor:
        """``input_ids`` / ``positions`` int64 ``[T]`` -> hidden ``[T, hidden_size]`` in the model dtype."""
        s = self.spec
        x = self.embed[input_ids] + torch.sin(positions[:, None].to(torch.float64) * self.freqs[None, :]).to(s.dtype)
        t = x.shape[0]
        q = (x @ self.wq).view(t, s.num_heads, s.head_size)
        k = (x @ self.wk).view(t, s.num_kv_heads, s.head_size)
        v = (x @ self.wv).view(t, s.num_kv_heads, s.head_size)
        o = self.attention.forward(q, k, v, self.kv_cache, attn_metadata)
        return x + o.reshape(t, s.num_heads * s.head_size) @ self.wo
