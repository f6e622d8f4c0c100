"""Random paged-attention steps for the ``cpu`` backend and an independent float64 reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from corerun.protocols.attention import AttentionBatch, AttentionSpec
from corerun.testing import requests_step
from corerun_attention_cpu.kernels import find_compiler

# Without any C++ compiler the backend is unavailable by design (the probe tests cover that); the
# tests that run the kernel skip, with the reason.  A compiler that is present but fails is a failure.
needs_compiler = pytest.mark.skipif(
    find_compiler()[0] is None, reason="no C++ compiler here ($CXX, c++, g++, clang++): the cpu backend is unavailable"
)

# dtype -> (rms, max) relative error bounds against float64 (docs/conformance.md's tolerances)
TOLERANCE = {torch.float32: (2e-6, 2e-5), torch.float16: (1.5e-3, 5e-3), torch.bfloat16: (4e-3, 1e-2)}


def make_spec(num_heads=9, num_kv_heads=3, head_size=64, dtype=torch.float32, block_size=16) -> AttentionSpec:
    return AttentionSpec(num_heads, num_kv_heads, head_size, dtype, block_size, torch.device("cpu"))


@dataclass
class Step:
    batch: AttentionBatch
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    cache: torch.Tensor
    requests: list[tuple[int, int]]  # (cached context, new tokens), decodes first


def make_step(backend, spec: AttentionSpec, requests: list[tuple[int, int]], seed: int = 0, spare_blocks: int = 3) -> Step:
    """A step over a cache full of finite garbage, block tables a random permutation of the blocks,
    padding columns pointing at a block no request owns."""
    gen = torch.Generator().manual_seed(seed)
    bs = spec.block_size
    seq = [c + q for c, q in requests]
    need = [(s + bs - 1) // bs for s in seq]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(need) + 2
    tables = torch.full((len(requests), width), int(perm[-1]), dtype=torch.int32)  # padding: a spare block
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[at : at + n].to(torch.int32)
        at += n
    qlens = [q for _, q in requests]
    batch = requests_step([c for c, _ in requests], qlens, tables.tolist(), bs).batch
    t = sum(qlens)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(spec.dtype)  # noqa: E731
    cache = backend.allocate_kv_cache(num_blocks)
    k, v = backend.kv_cache_view(cache)
    k.copy_(rnd(*k.shape) * 2)
    v.copy_(rnd(*v.shape) * 2)
    return Step(batch, rnd(t, spec.num_heads, spec.head_size), rnd(t, spec.num_kv_heads, spec.head_size),
                rnd(t, spec.num_kv_heads, spec.head_size), cache, list(requests))


def reference(backend, spec: AttentionSpec, step: Step) -> torch.Tensor:
    """float64 attention read position by position through the block tables of the cache *after* the write."""
    k_cache, v_cache = (x.to(torch.float64) for x in backend.kv_cache_view(step.cache))
    bs, g = spec.block_size, spec.num_heads // spec.num_kv_heads
    out = torch.full((step.batch.num_tokens, spec.num_heads, spec.head_size), float("nan"), dtype=torch.float64)
    start = 0
    for i, (ctx, qlen) in enumerate(step.requests):
        pos = torch.arange(ctx + qlen)
        blocks = step.batch.block_tables[i, pos // bs].long()
        k = k_cache[blocks, pos % bs].repeat_interleave(g, dim=1)  # [S, Hq, D]
        v = v_cache[blocks, pos % bs].repeat_interleave(g, dim=1)
        q = step.query[start : start + qlen].to(torch.float64)  # [L, Hq, D]
        scores = torch.einsum("lhd,shd->hls", q, k) * spec.softmax_scale
        causal = pos[None, :] <= (ctx + torch.arange(qlen))[:, None]  # [L, S]
        scores = scores.masked_fill(~causal, float("-inf"))
        out[start : start + qlen] = torch.einsum("hls,shd->lhd", torch.softmax(scores, dim=-1), v)
        start += qlen
    return out


def relative_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    err = out.to(torch.float64) - ref
    return (err.norm() / ref.norm()).item(), (err.abs().max() / ref.abs().max()).item()
