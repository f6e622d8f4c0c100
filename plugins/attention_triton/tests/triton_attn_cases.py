"""Test batches over a poisoned paged cache, and the float64 reference the kernels are checked against.

The reference is deliberately naive and shares no code with the plugin: the expected cache is built by
a Python loop over the slot mapping, and attention is a per-request, per-token loop in float64 that
reads each position's K/V through the block table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from corerun.protocols.attention import AttentionBatch, AttentionSpec
from corerun.testing import assert_rel_err

from corerun_attention_triton.backend import TritonAttentionBackend

NAN = float("nan")
# Largest allowed max|out - ref| / max|ref|: float32 far under 1e-4; half precisions a few 1e-3.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 5e-3}


def make_spec(
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 64,
    dtype: torch.dtype = torch.float32,
    block_size: int = 16,
) -> AttentionSpec:
    return AttentionSpec(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
        block_size=block_size, device=torch.device("cpu"),
    )


@dataclass
class Case:
    """One step: requests ``(context_len, query_len)``, inputs, the cache, and what should come out."""

    spec: AttentionSpec
    reqs: list[tuple[int, int]]
    batch: AttentionBatch
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D] (a strided view into a fused qkv-like tensor)
    value: torch.Tensor
    kv_cache: torch.Tensor  # the backend's layout, NaN wherever nothing was written
    expected_k: torch.Tensor  # float64 [num_blocks, block_size, Hkv, D]: the cache after this step's writes
    expected_v: torch.Tensor
    num_real_tokens: int  # tokens before the padding rows


def build_case(
    backend: TritonAttentionBackend,
    reqs: list[tuple[int, int]],
    *,
    pad_rows: int = 0,
    seed: int = 0,
    max_seq_len: int | None = None,
    table_width: int = 0,
) -> Case:
    """A batch of ``reqs`` (decodes must come first) plus ``pad_rows`` CUDA-graph padding decodes.

    ``max_seq_len`` overrides the batch's bound (a capture passes max_model_len); ``table_width``
    widens the block table (a graph runner's buffer is sized for max_model_len).

    Physical blocks are a random permutation (non-contiguous tables); the cache starts all NaN, the
    cached prefixes are then written directly through the canonical views; block-table padding
    entries point at a block that stays NaN, so reading anything outside the sequences shows up.
    """
    spec = backend.spec
    bs, hkv, h, d = spec.block_size, spec.num_kv_heads, spec.num_heads, spec.head_size
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in reqs]
    blocks_per_req = [math.ceil(s / bs) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    poison_block = perm.pop()
    width = max(blocks_per_req + [table_width - 1]) + 1
    table = torch.full((len(reqs) + pad_rows, width), poison_block, dtype=torch.int32)
    for i, n in enumerate(blocks_per_req):
        table[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    table[len(reqs):] = 0  # what a CUDA-graph runner leaves in padding rows

    kv_cache = backend.allocate_kv_cache(num_blocks)
    k_view, v_view = backend.kv_cache_view(kv_cache)
    k_view.fill_(NAN)
    v_view.fill_(NAN)

    def slot(req: int, pos: int) -> int:
        return int(table[req, pos // bs]) * bs + pos % bs

    cached = torch.tensor([slot(i, pos) for i, (ctx, _) in enumerate(reqs) for pos in range(ctx)], dtype=torch.long)
    k_view.view(-1, hkv, d)[cached] = torch.randn(len(cached), hkv, d, generator=gen).to(spec.dtype)
    v_view.view(-1, hkv, d)[cached] = torch.randn(len(cached), hkv, d, generator=gen).to(spec.dtype)

    num_tokens = sum(q for _, q in reqs) + pad_rows
    query = torch.randn(num_tokens, h, d, generator=gen).to(spec.dtype)
    qkv = torch.randn(num_tokens, 2 * hkv + 1, d, generator=gen).to(spec.dtype)
    key, value = qkv[:, 1 : 1 + hkv], qkv[:, 1 + hkv :]  # strided, like a fused projection's output
    slots = [slot(i, ctx + j) for i, (ctx, q) in enumerate(reqs) for j in range(q)] + [-1] * pad_rows

    expected_k, expected_v = k_view.double().clone(), v_view.double().clone()
    for t, s in enumerate(slots):
        if s >= 0:
            expected_k[s // bs, s % bs] = key[t].double()
            expected_v[s // bs, s % bs] = value[t].double()

    q_lens = [q for _, q in reqs] + [1] * pad_rows
    ctx_lens = [c for c, _ in reqs] + [0] * pad_rows
    all_seq = [c + q for c, q in zip(ctx_lens, q_lens)]
    num_decodes = 0
    while num_decodes < len(reqs) and reqs[num_decodes][1] == 1:
        num_decodes += 1
    if num_decodes == len(reqs):
        num_decodes += pad_rows
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    batch = AttentionBatch(
        query_start_loc=qsl,
        seq_lens=torch.tensor(all_seq, dtype=torch.int32),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        block_tables=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_reqs=len(q_lens),
        num_tokens=num_tokens,
        max_query_len=max(q_lens),
        max_seq_len=max(all_seq) if max_seq_len is None else max_seq_len,
        num_decodes=num_decodes,
        query_start_loc_cpu=qsl.clone(),
        seq_lens_cpu=torch.tensor(all_seq, dtype=torch.int32),
    )
    return Case(spec, list(reqs), batch, query, key, value, kv_cache, expected_k, expected_v, num_tokens - pad_rows)


def reference_attention(case: Case) -> torch.Tensor:
    """float64 ``[num_real_tokens, H, D]``: per request, per query token, softmax over visible keys."""
    spec, b = case.spec, case.batch
    bs, group = spec.block_size, spec.num_heads // spec.num_kv_heads
    out = torch.empty(case.num_real_tokens, spec.num_heads, spec.head_size, dtype=torch.float64)
    for i, (ctx, q_len) in enumerate(case.reqs):
        seq_len = ctx + q_len
        pos = torch.arange(seq_len)
        blocks = b.block_tables[i, pos // bs].long()  # only the entries this sequence owns
        k = case.expected_k[blocks, pos % bs]  # [S, Hkv, D]
        v = case.expected_v[blocks, pos % bs]
        k = k.repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.repeat_interleave(group, dim=1)
        start = int(b.query_start_loc[i])
        for j in range(q_len):
            visible = ctx + j + 1
            q = case.query[start + j].double()  # [H, D]
            scores = torch.einsum("hd,shd->hs", q, k[:visible]) * spec.softmax_scale
            out[start + j] = torch.einsum("hs,shd->hd", scores.softmax(dim=-1), v[:visible])
    return out


def run_and_check(backend: TritonAttentionBackend, case: Case, metadata=None) -> float:
    """Forward into a NaN-poisoned ``out``; check the cache writes exactly and the output; return the error."""
    out = torch.full_like(case.query, NAN)
    metadata = backend.plan(case.batch) if metadata is None else metadata
    result = backend.forward(case.query, case.key, case.value, case.kv_cache, metadata, out=out)
    assert result.data_ptr() == out.data_ptr()
    k_view, v_view = backend.kv_cache_view(case.kv_cache)
    torch.testing.assert_close(k_view.double(), case.expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_view.double(), case.expected_v, rtol=0, atol=0, equal_nan=True)
    real = out[: case.num_real_tokens]
    assert not real.isnan().any(), "some output rows of real tokens were not written (NaN poison left)"
    return assert_rel_err(real, reference_attention(case), TOLERANCE[case.spec.dtype], what=f"attention output for {case.reqs}")
