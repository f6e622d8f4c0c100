"""Quantized KV caches in the cpu kernel (fp8 e4m3 / e5m2 with per-tensor scales, int8 with per-row scales) at
the head sizes it specialises (64, 128) and one it does not (80), in bfloat16 and float32: a step over a context
written by ``write_kv`` against float64 attention over the K/V the conformance reference rounds (from frexp)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from corerun.conformance.reference.attention import paged_attention_reference
from corerun.conformance.reference.kv_quant import fake_quant
from corerun.conformance.tolerances import within
from corerun.protocols.step_layout import requests_step
from corerun_attention_cpu.backend import CpuAttentionBackend
from cpu_attn_cases import make_spec, needs_compiler


def _run(backend, spec, requests, tables, keys, values, query):
    bs = spec.block_size
    cache = backend.allocate_kv_cache(max(max(t) for t in tables) + 1)
    ctx_rows = [(i, p) for i, (c, _) in enumerate(requests) for p in range(c)]
    slot = lambda i, p: tables[i][p // bs] * bs + p % bs  # noqa: E731
    backend.write_kv(torch.stack([keys[i][p] for i, p in ctx_rows]), torch.stack([values[i][p] for i, p in ctx_rows]),
                     cache, torch.tensor([slot(i, p) for i, p in ctx_rows]))
    new = [(i, p) for i, (c, q) in enumerate(requests) for p in range(c, c + q)]
    batch = requests_step([c for c, _ in requests], [q for _, q in requests], tables, bs).batch
    return backend.forward(query, torch.stack([keys[i][p] for i, p in new]), torch.stack([values[i][p] for i, p in new]),
                           cache, backend.plan(batch))


@needs_compiler
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize(("dtype", "head_size"), [(torch.bfloat16, 64), (torch.float32, 128), (torch.bfloat16, 80)])
def test_quantized_cache_matches_the_torch_reference(kv: str, dtype: torch.dtype, head_size: int) -> None:
    spec = replace(make_spec(head_size=head_size, dtype=dtype), kv_cache_dtype=kv, kv_scales=(0.6, 1.4))
    gen = torch.Generator().manual_seed(11)
    requests = [(37, 1), (5, 1), (0, 19), (20, 6)]  # decodes first
    perm = torch.randperm(12, generator=gen).tolist()
    tables = [perm[0:3], perm[3:4], perm[4:6], perm[6:8]]
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    keys = [rnd(c + q, spec.num_kv_heads, head_size) for c, q in requests]
    values = [rnd(c + q, spec.num_kv_heads, head_size) for c, q in requests]
    query = rnd(sum(q for _, q in requests), spec.num_heads, head_size)
    got = _run(CpuAttentionBackend(spec), spec, requests, tables, keys, values, query)
    bs, shape = spec.block_size, (spec.num_kv_heads, head_size)
    paged_k, paged_v = torch.zeros(12, bs, *shape, dtype=torch.float64), torch.zeros(12, bs, *shape, dtype=torch.float64)
    for t, k, v in zip(tables, keys, values):
        for p in range(k.shape[0]):
            paged_k[t[p // bs], p % bs] = fake_quant(k[p], kv, spec.kv_scales[0])
            paged_v[t[p // bs], p % bs] = fake_quant(v[p], kv, spec.kv_scales[1])
    want = paged_attention_reference(query, paged_k, paged_v, tables, [c for c, _ in requests], [q for _, q in requests],
                                     spec.softmax_scale)
    ok, how = within(str(dtype).removeprefix("torch."), got, want)
    assert ok, how
