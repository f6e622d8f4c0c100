"""Builds one attention step for the suite: a poisoned, shuffled paged cache, a batch, and its float64 answer.

Every cache slot no request owns holds finite garbage, block tables are random permutations of the
physical blocks (padding entries point at garbage blocks), so a backend that reads a slot it should
not, or writes one it should not, changes the answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from corerun.conformance.reference.attention import paged_attention_reference
from corerun.conformance.tolerances import within
from corerun.protocols.attention import AttentionBatch, AttentionSpec, dtype_name
from corerun.protocols.step_layout import requests_step


@dataclass
class Scenario:
    """One step: ``requests[i] = (context_len, query_len)``; tensors on the spec's device."""

    spec: AttentionSpec
    requests: list[tuple[int, int]]
    num_padding: int
    cache: torch.Tensor
    batch: AttentionBatch
    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor
    block_tables: list[list[int]]
    slots: list[int]  # per token, -1 for padding
    k_before: torch.Tensor  # the cache's canonical K view before the step (spec dtype, cpu)
    v_before: torch.Tensor
    reference: torch.Tensor  # float64 [num_real_tokens, num_heads, head_size]

    @property
    def num_real_tokens(self) -> int:
        return sum(q for _, q in self.requests)


def _describe(ctx: int, qlen: int, block_size: int) -> str:
    seq = ctx + qlen
    kind = "decode" if qlen == 1 else ("prefill" if ctx == 0 else "prefill after a cached prefix")
    return f"{kind} (context {ctx}, query {qlen}, sequence {seq} = {seq // block_size} full blocks + {seq % block_size})"


def build_scenario(
    backend: Any,
    spec: AttentionSpec,
    requests: list[tuple[int, int]],
    *,
    seed: int,
    num_padding: int = 0,
    extra_seq_len: int = 0,
    spare_blocks: int = 3,
    layout: str = "random",
    layer: int = 0,
) -> Scenario:
    """Set up the cache and batch for ``requests`` (decodes, i.e. ``query_len == 1``, must come first).

    ``num_padding`` appends CUDA-graph padding rows (decodes of length 1 with slot -1);
    ``extra_seq_len`` makes ``max_seq_len`` a loose upper bound (the block tables widen to match);
    ``layout`` is ``"random"`` (a random permutation of blocks) or ``"reversed"`` (descending ids);
    ``layer``: the layer whose window (``spec.sliding_window(layer)``) the reference applies.
    """
    gen = torch.Generator().manual_seed(seed)
    dev, dt, bs = spec.device, spec.dtype, spec.block_size
    hkv, hq, d = spec.num_kv_heads, spec.num_heads, spec.head_size

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dt)

    seq_lens = [c + q for c, q in requests]
    need = [-(-s // bs) for s in seq_lens]
    total = sum(need) + spare_blocks
    order = torch.randperm(total, generator=gen).tolist() if layout == "random" else list(range(total - 1, -1, -1))
    garbage = order[sum(need):]
    max_seq = max(seq_lens + [1] * num_padding) + extra_seq_len
    width = -(-max_seq // bs)
    tables, cursor = [], 0
    for n in need:
        own = order[cursor:cursor + n]
        cursor += n
        pad = [garbage[(cursor + i) % len(garbage)] for i in range(width - n)]
        tables.append(own + pad)
    tables += [[0] * width for _ in range(num_padding)]

    cache = backend.allocate_kv_cache(total)
    kview, vview = backend.kv_cache_view(cache)
    kview.copy_(randn(total, bs, hkv, d, scale=2.0).to(dev))  # finite garbage everywhere
    vview.copy_(randn(total, bs, hkv, d, scale=2.0).to(dev))
    for (ctx, _), table in zip(requests, tables):
        if ctx:
            pos = torch.arange(ctx)
            blk = torch.tensor(table, dtype=torch.long)[pos // bs]
            kview[blk.to(dev), (pos % bs).to(dev)] = randn(ctx, hkv, d).to(dev)
            vview[blk.to(dev), (pos % bs).to(dev)] = randn(ctx, hkv, d).to(dev)

    slots: list[int] = []
    for (ctx, qlen), table in zip(requests, tables):
        slots += [table[p // bs] * bs + p % bs for p in range(ctx, ctx + qlen)]
    slots += [-1] * num_padding
    num_tokens = len(slots)
    query, key, value = randn(num_tokens, hq, d), randn(num_tokens, hkv, d), randn(num_tokens, hkv, d)

    k_before, v_before = kview.detach().cpu().clone(), vview.detach().cpu().clone()
    k_exp, v_exp = k_before.to(torch.float64), v_before.to(torch.float64)
    real = torch.tensor([s for s in slots if s >= 0], dtype=torch.long)
    n_real = len(real)
    k_exp[real // bs, real % bs] = key[:n_real].to(torch.float64)
    v_exp[real // bs, real % bs] = value[:n_real].to(torch.float64)
    reference = paged_attention_reference(
        query[:n_real], k_exp, v_exp, tables[: len(requests)], [c for c, _ in requests], [q for _, q in requests], spec.softmax_scale,
        window=spec.sliding_window(layer), soft_cap=spec.logits_soft_cap,
    )

    batch = requests_step(
        [c for c, _ in requests], [q for _, q in requests], tables[: len(requests)], bs, dev,
        num_padding=num_padding, max_seq_len=max_seq,
    ).batch
    return Scenario(
        spec, list(requests), num_padding, cache, batch, query.to(dev), key.to(dev), value.to(dev),
        tables, slots, k_before, v_before, reference,
    )


def output_failures(sc: Scenario, out: torch.Tensor) -> list[str]:
    """Per-request comparison of the real rows of ``out`` with the float64 reference."""
    problems: list[str] = []
    expected_shape = (sc.batch.num_tokens, sc.spec.num_heads, sc.spec.head_size)
    if tuple(out.shape) != expected_shape:
        return [f"output has shape {tuple(out.shape)}, expected {expected_shape} (num_tokens, num_heads, head_size)"]
    got = out.detach().cpu()
    row = 0
    for i, (ctx, qlen) in enumerate(sc.requests):
        ok, how = within(dtype_name(sc.spec.dtype), got[row:row + qlen], sc.reference[row:row + qlen])
        if not ok:
            problems.append(f"request {i}, {_describe(ctx, qlen, sc.spec.block_size)}: {how}")
        row += qlen
    return problems


def cache_failures(sc: Scenario, backend: Any) -> list[str]:
    """Exact check of the cache after the step: new K/V at their slots, every other slot untouched."""
    bs = sc.spec.block_size
    kview, vview = backend.kv_cache_view(sc.cache)
    problems: list[str] = []
    real = [(i, s) for i, s in enumerate(sc.slots) if s >= 0]
    for name, view, before, new in (("K", kview, sc.k_before, sc.key), ("V", vview, sc.v_before, sc.value)):
        expected = before.clone()
        if real:
            idx = torch.tensor([s for _, s in real])
            expected[idx // bs, idx % bs] = new[[i for i, _ in real]].detach().cpu()
        after = view.detach().cpu()
        differs = (after != expected).flatten(2).any(-1)  # [num_blocks, block_size]: any head/element differs
        named = torch.zeros_like(differs)
        if real:
            named[idx // bs, idx % bs] = True
        wrong_named = torch.nonzero(differs & named).tolist()
        stray = torch.nonzero(differs & ~named).tolist()
        if wrong_named:
            b, o = wrong_named[0]
            problems.append(
                f"{name} cache: {len(wrong_named)} of {len(real)} named slots do not hold this step's {name} "
                f"(first: slot {b * bs + o} = block {b} offset {o})"
            )
        if stray:
            b, o = stray[0]
            problems.append(
                f"{name} cache: {len(stray)} slots changed that no token names (first: slot {b * bs + o} = block {b} "
                f"offset {o}); writes must land only at slot_mapping, and -1 writes nothing"
            )
    return problems
