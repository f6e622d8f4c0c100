"""The flash-attn emulator against flash-attn's documented examples, and the preconditions it enforces.

The backend tests trust the emulator as a stand-in for flash-attn; these pin it to the contract
stated in flash-attn's docstrings, independently of the backend.
"""

from __future__ import annotations

import sys

import pytest
import torch

from corerun_attention_flash import emulation
from corerun_attention_flash.testing import emulated, flash_attn_emulator as fa2, flash_attn_interface_emulator as fa3

# flash-attn's docstring: "If causal=True, the causal mask is aligned to the bottom right corner."
DOCUMENTED_MASKS = {
    (2, 5): [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]],
    (5, 2): [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]],  # "If the row of the mask is all zero, the output will be zero."
}


@pytest.mark.parametrize("shape", list(DOCUMENTED_MASKS), ids=lambda s: f"q{s[0]}-k{s[1]}")
def test_bottom_right_causal_mask_as_documented(shape):
    """q = 0 makes every visible key equally likely; v[j] = one-hot(j) then reads the mask off the output."""
    sq, sk = shape
    q = torch.zeros(sq, 1, 8, dtype=torch.float16)
    v = torch.zeros(sk, 1, 8, dtype=torch.float16)
    v[torch.arange(sk), 0, torch.arange(sk)] = 1
    k = torch.randn(sk, 1, 8).half()
    cu_q = torch.tensor([0, sq], dtype=torch.int32)
    cu_k = torch.tensor([0, sk], dtype=torch.int32)
    out = fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, sq, sk, causal=True)
    mask = torch.tensor(DOCUMENTED_MASKS[shape], dtype=torch.float64)
    expected = mask / mask.sum(dim=1, keepdim=True).clamp(min=1)
    torch.testing.assert_close(out[:, 0, :sk].double(), expected, atol=1e-3, rtol=0)


def test_gqa_head_mapping_as_documented():
    """'If Q has 6 heads and K, V have 2 heads, head 0, 1, 2 of Q will attention to head 0 of K, V.'

    KV head 0's keys single out position 0 and its values are ``p``; KV head 1's single out
    position 3 and its values are ``10 + p``: query heads 0-2 must read ~0, heads 3-5 ~13.
    """
    q = torch.ones(1, 1, 6, 8, dtype=torch.float16)
    k_cache = torch.zeros(1, 4, 2, 8, dtype=torch.float16)
    k_cache[0, 0, 0] = 4.0
    k_cache[0, 3, 1] = 4.0
    v_cache = torch.arange(4, dtype=torch.float16).view(1, 4, 1, 1).repeat(1, 1, 2, 8)
    v_cache[:, :, 1] += 10
    out = fa2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([4], dtype=torch.int32))
    expected = torch.tensor([0.0] * 3 + [13.0] * 3).view(6, 1).expand(6, 8)
    torch.testing.assert_close(out[0, 0].double(), expected.double(), atol=0.02, rtol=0)


def test_paged_read_follows_the_block_table_and_stops_at_the_length():
    """Keys come from the listed blocks in order; slots past cache_seqlens (NaN here) are never read."""
    page = 256
    k_cache = torch.full((3, page, 1, 8), float("nan"), dtype=torch.float16)
    v_cache = torch.full((3, page, 1, 8), float("nan"), dtype=torch.float16)
    keys = torch.randn(page + 3, 1, 8).half()
    values = torch.randn(page + 3, 1, 8).half()
    k_cache[2], v_cache[2] = keys[:page], values[:page]
    k_cache[0, :3], v_cache[0, :3] = keys[page:], values[page:]
    q = torch.randn(1, 1, 2, 8).half()
    table = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    out = fa2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([page + 3], dtype=torch.int32),
                                      block_table=table, softmax_scale=0.5, causal=True)
    weights = torch.softmax((q[0, 0].double() @ keys[:, 0].double().T) * 0.5, dim=-1)
    torch.testing.assert_close(out[0, 0].double(), weights @ values[:, 0].double(), atol=2e-3, rtol=0)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(dtype=torch.float32), "only support fp16 and bf16"),
        (dict(page=16), "divisible by 256"),
        (dict(cu_dtype=torch.int64), "cu_seqlens_q must have dtype torch.int32"),
        (dict(table_dtype=torch.int64), "block_table must have dtype torch.int32"),
        (dict(max_seqlen_q=2), "max_seqlen_q is 2"),
        (dict(head_size=264), "head dimension at most 256"),
        (dict(kv_heads=3), "must divide number of heads"),
    ],
    ids=["float32", "page16", "cu-int64", "table-int64", "max-q-short", "hd264", "heads"],
)
def test_fa2_varlen_preconditions(change, message):
    d = change.get("head_size", 8)
    page = change.get("page", 256)
    dtype = change.get("dtype", torch.float16)
    q = torch.randn(3, 4, d).to(dtype)
    kv = torch.randn(2, page, change.get("kv_heads", 2), d).to(dtype)
    cu = torch.tensor([0, 3], dtype=change.get("cu_dtype", torch.int32))
    table = torch.tensor([[1]], dtype=change.get("table_dtype", torch.int32))
    with pytest.raises((RuntimeError, ValueError), match=message):
        fa2.flash_attn_varlen_func(q, kv, kv, cu, torch.tensor([0, 3], dtype=torch.int32), change.get("max_seqlen_q", 3), 3,
                                   causal=True, block_table=table)


def test_unimplemented_features_are_refused_not_ignored():
    q = torch.randn(1, 1, 2, 8).half()
    kv = torch.randn(1, 256, 2, 8).half()
    with pytest.raises(NotImplementedError, match="sliding_window"):
        fa2.flash_attn_with_kvcache(q, kv, kv, cache_seqlens=1, window_size=(4, 0))
    with pytest.raises(NotImplementedError, match="appending_k_v"):
        fa3.flash_attn_with_kvcache(q, kv, kv, k=q, v=q, cache_seqlens=1)


def test_fa3_pages_of_any_size_and_packed_queries():
    """FA3: 'page_block_size can be arbitrary'; with cu_seqlens_q the queries are packed, each request causal."""
    page = 3
    k_cache = torch.randn(4, page, 1, 8).half()
    v_cache = torch.randn(4, page, 1, 8).half()
    table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    lengths = torch.tensor([5, 2], dtype=torch.int32)
    q = torch.randn(3, 2, 8).half()  # request 0: 2 queries, request 1: 1 query
    out = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, page_table=table,
                                      cu_seqlens_q=torch.tensor([0, 2, 3], dtype=torch.int32), max_seqlen_q=2, causal=True)
    keys0 = torch.cat([k_cache[3], k_cache[1]])[:5, 0].double()
    vals0 = torch.cat([v_cache[3], v_cache[1]])[:5, 0].double()
    for j, visible in ((0, 4), (1, 5)):  # bottom-right: query j of 2 sees keys 0 .. 5 - 2 + j
        for h in range(2):
            w = torch.softmax(keys0[:visible] @ q[j, h].double() * 8 ** -0.5, dim=-1)
            torch.testing.assert_close(out[j, h].double(), w @ vals0[:visible], atol=2e-3, rtol=0)


def test_emulated_restores_modules_and_state():
    before = {name: sys.modules.get(name) for name in ("flash_attn", "flash_attn_interface")}
    with emulated("flash_attn_interface", allow_float64=True) as flash:
        assert sys.modules["flash_attn_interface"] is fa3 and sys.modules["flash_attn"] is None
        assert emulation.current().hopper and torch.float64 in fa2.ALLOWED_DTYPES
        assert flash.capabilities.devices == {"cpu", "cuda"} and "float64" in flash.capabilities.dtypes
    assert {name: sys.modules.get(name) for name in before} == before
    assert emulation.current() is None and torch.float64 not in fa2.ALLOWED_DTYPES
    with pytest.raises(ValueError, match="library must be one of"):
        with emulated("flash_attn_3"):
            pass
