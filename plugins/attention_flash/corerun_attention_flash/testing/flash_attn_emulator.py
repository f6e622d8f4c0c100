"""EMULATOR of flash-attn 2's inference entry points (``flash_attn``), for tests on machines without a GPU.

This is not flash-attn and is never used by the backend.  It re-implements, in float64 torch, the
behaviour flash-attn documents in the docstrings of ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache`` (flash_attn/flash_attn_interface.py) and enforces the preconditions its
C++ entry points check, so that the backend's argument plumbing can be tested on CPU:

- q/k/v in float16 or bfloat16 (``ALLOWED_DTYPES``; tests may add float64), one dtype for all;
- last dimension contiguous; head size at most 256; query heads a multiple of KV heads, query head
  ``h`` reading KV head ``h // (nheads // nheads_k)`` (GQA / MQA);
- ``cu_seqlens_*``, ``cache_seqlens``, ``block_table`` int32; ``block_table`` ``[batch, max_blocks]``
  with a contiguous last dimension; a paged cache ``[num_blocks, page_block_size, nheads_k, headdim]``
  with ``page_block_size % PAGE_MULTIPLE == 0`` (256 for FA2);
- ``causal=True`` aligns the mask to the bottom-right corner: query ``i`` of ``seqlen_q`` sees keys
  ``j <= i + seqlen_k - seqlen_q``; a query row that sees no key outputs zeros;
- ``softmax_scale=None`` means ``headdim ** -0.5``.

Stricter than the real kernels where they cannot check without a device sync: ``max_seqlen_q`` /
``max_seqlen_k`` below a request's actual length, a block id outside the cache, or a block table too
short for ``cache_seqlens`` raise ``ValueError`` (the real kernels would read garbage).  Features
corerun does not use (dropout, sliding windows, softcap, ALiBi, rotary, appending ``k``/``v``,
returned LSE) raise ``NotImplementedError`` rather than being ignored.
"""

from __future__ import annotations

import torch

__version__ = "2.8.3+cpu-emulator"
PAGE_MULTIPLE = 256
MAX_HEAD_SIZE = 256
ALLOWED_DTYPES: set[torch.dtype] = {torch.float16, torch.bfloat16}


def _require(condition: bool, message: str, exc: type[Exception] = RuntimeError) -> None:
    if not condition:
        raise exc(message)


def _unsupported(**features: bool) -> None:
    used = [name for name, on in features.items() if on]
    if used:
        raise NotImplementedError(f"the flash-attn emulator does not implement {', '.join(used)}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _require(q.dtype in ALLOWED_DTYPES, f"FlashAttention only support fp16 and bf16 data type, got {q.dtype}")
    _require(k.dtype == q.dtype and v.dtype == q.dtype, "query and key/value must have the same dtype")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require(t.stride(-1) == 1, f"{name} must have contiguous last dimension")
    _require(q.shape[-1] <= MAX_HEAD_SIZE, "FlashAttention forward only supports head dimension at most 256")
    _require(k.shape[-1] == q.shape[-1] and v.shape[-1] == q.shape[-1], "q, k, v must have the same head dimension")
    _require(q.shape[-2] % k.shape[-2] == 0, "Number of heads in key/value must divide number of heads in query")
    _require(v.shape[-2] == k.shape[-2], "k and v must have the same number of heads")


def check_index(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    _require(t.dtype == torch.int32, f"{name} must have dtype torch.int32, got {t.dtype}")
    _require(tuple(t.shape) == shape, f"{name} must have shape {shape}, got {tuple(t.shape)}")
    _require(t.dim() == 0 or t.stride(-1) == 1, f"{name} must have contiguous last dimension")


def check_paged(k_cache: torch.Tensor, block_table: torch.Tensor, batch: int, page_multiple: int) -> None:
    _require(k_cache.dim() == 4, f"a paged cache is [num_blocks, page_block_size, nheads_k, headdim], got {tuple(k_cache.shape)}")
    _require(k_cache.shape[1] % page_multiple == 0, "Paged KV cache block size must be divisible by 256")
    check_index("block_table", block_table, (batch, block_table.shape[1] if block_table.dim() == 2 else -1))


def gather_pages(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """Tokens ``0 .. length-1`` of one sequence from a paged cache -> ``[length, nheads_k, headdim]``."""
    page = cache.shape[1]
    needed = -(-length // page)
    _require(needed <= block_ids.numel(), f"block_table row has {block_ids.numel()} blocks, {length} keys need {needed}", ValueError)
    ids = block_ids[:needed].long()
    _require(bool(((ids >= 0) & (ids < cache.shape[0])).all()), f"block id out of range [0, {cache.shape[0]}): {ids.tolist()}", ValueError)
    return cache[ids].reshape(needed * page, *cache.shape[2:])[:length]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """One sequence, float64: ``q`` ``[sq, H, D]``, ``k``/``v`` ``[sk, Hk, D]`` -> ``[sq, H, D]`` (float64)."""
    sq, sk = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if causal:
        row = torch.arange(sq).view(sq, 1)
        col = torch.arange(sk).view(1, sk)
        keep = (col <= row + (sk - sq)).to(q.device)
    else:
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no visible key -> zeros
    return torch.einsum("hqk,khd->qhd", probs, vv)


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
):
    """q ``(total_q, nheads, headdim)``; k/v ``(total_k, nheads_k, headdim)``, or paged
    ``(num_blocks, page_block_size, nheads_k, headdim)`` with ``block_table``; returns ``(total_q, nheads, headdim)``."""
    _unsupported(dropout=dropout_p != 0.0, sliding_window=tuple(window_size) != (-1, -1), softcap=softcap != 0.0,
                 alibi=alibi_slopes is not None, return_attn_probs=bool(return_attn_probs))
    check_qkv(q, k, v)
    _require(q.dim() == 3, f"q must be (total_q, nheads, headdim), got {tuple(q.shape)}")
    batch = cu_seqlens_q.numel() - 1
    _require(batch > 0, "batch size must be positive")
    check_index("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    check_index("cu_seqlens_k", cu_seqlens_k, (batch + 1,))
    if block_table is not None:
        check_paged(k, block_table, batch, PAGE_MULTIPLE)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b in range(batch):
        sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        _require(0 <= sq <= max_seqlen_q, f"sequence {b}: {sq} queries, max_seqlen_q is {max_seqlen_q}", ValueError)
        _require(0 <= sk <= max_seqlen_k, f"sequence {b}: {sk} keys, max_seqlen_k is {max_seqlen_k}", ValueError)
        if block_table is not None:
            keys, values = gather_pages(k, block_table[b], sk), gather_pages(v, block_table[b], sk)
        else:
            keys, values = k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
        out[cq[b]:cq[b + 1]] = attend(q[cq[b]:cq[b + 1]], keys, values, scale, causal)
    return out.to(q.dtype)


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
    window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
    return_softmax_lse=False,
):
    """q ``(batch, seqlen, nheads, headdim)``; caches ``(batch_cache, seqlen_cache, nheads_k, headdim)`` or paged
    ``(num_blocks, page_block_size, nheads_k, headdim)`` with ``block_table``; returns ``(batch, seqlen, nheads, headdim)``."""
    _unsupported(appending_k_v=k is not None or v is not None, rotary=rotary_cos is not None,
                 cache_batch_idx=cache_batch_idx is not None, cache_leftpad=cache_leftpad is not None,
                 sliding_window=tuple(window_size) != (-1, -1), softcap=softcap != 0.0,
                 alibi=alibi_slopes is not None, return_softmax_lse=bool(return_softmax_lse))
    return kvcache_attention(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal, PAGE_MULTIPLE)


def kvcache_attention(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal, page_multiple):
    """Shared by the FA2 and FA3 emulators: attention of ``q`` ``(batch, seqlen, H, D)`` over a (paged) cache."""
    check_qkv(q, k_cache, v_cache)
    _require(q.dim() == 4, f"q must be (batch, seqlen, nheads, headdim), got {tuple(q.shape)}")
    batch = q.shape[0]
    _require(batch > 0, "batch size must be positive")
    if cache_seqlens is None:
        lengths = [k_cache.shape[1]] * batch
    elif isinstance(cache_seqlens, int):
        lengths = [cache_seqlens] * batch
    else:
        check_index("cache_seqlens", cache_seqlens, (batch,))
        lengths = cache_seqlens.tolist()
    if block_table is not None:
        check_paged(k_cache, block_table, batch, page_multiple)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b, length in enumerate(lengths):
        if block_table is not None:
            keys, values = gather_pages(k_cache, block_table[b], length), gather_pages(v_cache, block_table[b], length)
        else:
            _require(length <= k_cache.shape[1], f"cache_seqlens[{b}]={length} exceeds the cache's {k_cache.shape[1]}", ValueError)
            keys, values = k_cache[b, :length], v_cache[b, :length]
        out[b] = attend(q[b], keys, values, scale, causal)
    return out.to(q.dtype)
