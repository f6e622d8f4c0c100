"""Fixtures of the ``flash`` backend's tests: batches over a NaN-poisoned paged cache, and the float64
reference they are checked against (``cases.make_step``, ``cases.reference_attention``...).

The reference is written here, independently of the backend and of the flash-attn emulator: one
request at a time, from the logical (unpaged) K/V sequence, query ``j`` of a request with
``context_len`` cached tokens attending to positions ``0 .. context_len + j``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from corerun.protocols.attention import AttentionBatch, AttentionSpec
from corerun.testing import assert_rel_err, max_rel_err

TOLERANCE = {torch.float64: 1e-10, torch.float16: 1e-3, torch.bfloat16: 4e-3}


def make_spec(*, num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float64, block_size=256, scale=None) -> AttentionSpec:
    return AttentionSpec(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
        block_size=block_size, device=torch.device("cpu"), scale=scale,
    )


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """One request in float64: ``q`` ``[ql, H, D]``, ``k``/``v`` ``[context_len + ql, Hkv, D]`` -> ``[ql, H, D]``."""
    q, k, v = q.double(), k.double(), v.double()
    ql, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = torch.empty_like(q)
    position = context_len + torch.arange(ql).view(ql, 1)  # query j sits at context_len + j
    hidden = torch.arange(k.shape[0]).view(1, -1) > position  # keys after the query's own position
    for h in range(num_heads):
        kh = h // group
        logits = (q[:, h] @ k[:, kh].T) * scale
        logits = logits.masked_fill(hidden, float("-inf"))
        weights = torch.exp(logits - logits.max(dim=1, keepdim=True).values)
        out[:, h] = (weights / weights.sum(dim=1, keepdim=True)) @ v[:, kh]
    return out


@dataclass
class Step:
    """One step's inputs, the cache before it, and what the backend must produce."""

    batch: AttentionBatch
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    cache_before: torch.Tensor  # a copy of kv_cache before the step
    expected_cache: torch.Tensor  # cache_before with this step's real tokens written at their slots
    expected: torch.Tensor  # [num_real_tokens, H, D] float64
    num_real_tokens: int


def make_step(
    backend,
    context_lens: list[int],
    query_lens: list[int],
    *,
    num_decodes: int = 0,
    num_padding: int = 0,
    shuffle: bool = True,
    seed: int = 0,
) -> Step:
    """A batch of requests laid out back to back; the first ``num_decodes`` have one query token.

    ``num_padding`` appends CUDA-graph padding rows (decodes with ``seq_len`` 1, slot ``-1``) to a
    pure-decode batch.

    The cache starts all NaN except each request's cached prefix, so a token the backend fails to
    write, or a slot it reads beyond a sequence, shows up as NaN in the output.
    """
    spec: AttentionSpec = backend.spec
    assert all(q == 1 for q in query_lens[:num_decodes]), "decodes come first"
    assert num_padding == 0 or num_decodes == len(query_lens), "padding rows pad a pure-decode batch"
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D, bs, dtype = spec.num_heads, spec.num_kv_heads, spec.head_size, spec.block_size, spec.dtype
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_needed = [math.ceil(s / bs) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 2  # two spare blocks nobody owns (still NaN)
    order = torch.randperm(num_blocks, generator=g).tolist() if shuffle else list(range(num_blocks))
    spare = order[-1]
    width = max(blocks_needed) + 1  # at least one padding column per row
    table = torch.full((len(seq_lens) + num_padding, width), spare, dtype=torch.int32)
    owned, next_block = [], 0
    for i, n in enumerate(blocks_needed):
        owned.append(order[next_block:next_block + n])
        table[i, :n] = torch.tensor(owned[i], dtype=torch.int32)
        next_block += n

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    kv_cache = backend.allocate_kv_cache(num_blocks)
    k_view, v_view = backend.kv_cache_view(kv_cache)
    k_view.fill_(float("nan"))
    v_view.fill_(float("nan"))
    full_k = [randn(s, Hkv, D) for s in seq_lens]
    full_v = [randn(s, Hkv, D) for s in seq_lens]
    queries, keys, values, slots, expected = [], [], [], [], []
    expected_k, expected_v = k_view.clone(), v_view.clone()
    for i, (ctx, ql) in enumerate(zip(context_lens, query_lens)):
        pos = torch.arange(ctx + ql)
        block, offset = torch.tensor(owned[i])[pos // bs], pos % bs
        expected_k[block, offset] = full_k[i]
        expected_v[block, offset] = full_v[i]
        k_view[block[:ctx], offset[:ctx]] = full_k[i][:ctx]  # the cached prefix, as earlier steps wrote it
        v_view[block[:ctx], offset[:ctx]] = full_v[i][:ctx]
        slots += (block[ctx:] * bs + offset[ctx:]).tolist()
        q = randn(ql, H, D)
        queries.append(q)
        keys.append(full_k[i][ctx:])
        values.append(full_v[i][ctx:])
        expected.append(reference_attention(q, full_k[i], full_v[i], ctx, spec.softmax_scale))
    num_real = sum(query_lens)
    queries.append(randn(num_padding, H, D))
    keys.append(randn(num_padding, Hkv, D))
    values.append(randn(num_padding, Hkv, D))
    slots += [-1] * num_padding

    all_seq = seq_lens + [1] * num_padding
    all_ctx = context_lens + [0] * num_padding
    all_q = query_lens + [1] * num_padding
    starts = torch.tensor([0] + list(_accumulate(all_q)), dtype=torch.int32)
    batch = AttentionBatch(
        query_start_loc=starts,
        seq_lens=torch.tensor(all_seq, dtype=torch.int32),
        context_lens=torch.tensor(all_ctx, dtype=torch.int32),
        block_tables=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_reqs=len(all_seq),
        num_tokens=sum(all_q),
        max_query_len=max(all_q),
        max_seq_len=max(all_seq),
        num_decodes=num_decodes + num_padding,
        query_start_loc_cpu=starts.clone(),
        seq_lens_cpu=torch.tensor(all_seq, dtype=torch.int32),
    )
    return Step(
        batch=batch,
        query=torch.cat(queries),
        key=torch.cat(keys),
        value=torch.cat(values),
        kv_cache=kv_cache,
        cache_before=kv_cache.clone(),
        expected_cache=torch.stack([expected_k, expected_v]),
        expected=torch.cat(expected),
        num_real_tokens=num_real,
    )


def _accumulate(values: list[int]) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


def run_step(backend, step: Step, *, plan=None) -> torch.Tensor:
    """``backend.forward`` into a NaN-filled ``out``; returns ``out``."""
    out = torch.full_like(step.query, float("nan"))
    metadata = backend.plan(step.batch) if plan is None else plan
    result = backend.forward(step.query, step.key, step.value, step.kv_cache, metadata, out=out)
    assert result is out
    return out


def check_step(backend, step: Step, out: torch.Tensor) -> None:
    """Every real row written and within tolerance of the reference; the cache holds exactly the expected K/V."""
    real = out[: step.num_real_tokens]
    assert not real.isnan().any(), "a real token's output row was not written (or read a NaN slot)"
    assert_rel_err(real, step.expected, TOLERANCE[backend.spec.dtype], what="attention output")
    torch.testing.assert_close(step.kv_cache, step.expected_cache, rtol=0, atol=0, equal_nan=True)


@pytest.fixture
def cases() -> SimpleNamespace:
    return SimpleNamespace(
        TOLERANCE=TOLERANCE, make_spec=make_spec, make_step=make_step, reference_attention=reference_attention,
        relative_error=max_rel_err, run_step=run_step, check_step=check_step,
    )
