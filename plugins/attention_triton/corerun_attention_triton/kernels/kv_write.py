"""Write this step's K/V into the paged cache by slot mapping (vLLM's ``reshape_and_cache``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corerun_attention_triton.kernels import INTERPRET


@triton.jit
def kv_write_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_blk,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_blk,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Each program copies the K and V rows (``[num_kv_heads, head_size]`` each) of ``BLOCK_T`` tokens to their slots.

    - ``key_ptr`` / ``value_ptr``: ``[num_tokens, num_kv_heads, head_size]``, last dim contiguous,
      token and head strides given.
    - ``k_cache_ptr`` / ``v_cache_ptr``: ``[num_blocks, BLOCK_SIZE, num_kv_heads, head_size]``, last dim
      contiguous, block / slot / head strides given.
    - ``slot_mapping_ptr``: int64 ``[num_tokens]``, ``block * BLOCK_SIZE + offset``; ``-1`` writes nothing.

    ``HEADS_PAD`` / ``HEAD_PAD`` are ``num_kv_heads`` / ``head_size`` rounded up to powers of two; a
    token's heads are flattened into one row of ``HEADS_PAD * HEAD_PAD`` lanes.
    """
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_mapping_ptr + offs_t, mask=offs_t < num_tokens, other=-1).to(tl.int64)
    t_ok = slot >= 0
    slot = tl.where(t_ok, slot, 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_c = tl.arange(0, HEADS_PAD * HEAD_PAD)
    head = offs_c // HEAD_PAD
    dim = offs_c % HEAD_PAD
    mask = t_ok[:, None] & ((head < NUM_KV_HEADS) & (dim < HEAD_SIZE))[None, :]

    k = tl.load(key_ptr + offs_t[:, None] * stride_k_tok + (head * stride_k_head + dim)[None, :], mask=mask)
    k_dst = k_cache_ptr + (block * stride_kc_blk + offset * stride_kc_slot)[:, None] + (head * stride_kc_head + dim)[None, :]
    tl.store(k_dst, k, mask=mask)

    v = tl.load(value_ptr + offs_t[:, None] * stride_v_tok + (head * stride_v_head + dim)[None, :], mask=mask)
    v_dst = v_cache_ptr + (block * stride_vc_blk + offset * stride_vc_slot)[:, None] + (head * stride_vc_head + dim)[None, :]
    tl.store(v_dst, v, mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into the caches at ``slot_mapping``.

    ``k_cache``/``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_size]`` (views with a
    contiguous last dim); ``slot_mapping``: int64 ``[>= num_tokens]``, ``-1`` skips a token.
    Slots must lie below ``num_blocks * block_size`` (not checked: checking would need a device sync).
    """
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    # One token per program on a GPU (a few thousand lanes each); the interpreter pays per program.
    block_t = 32 if INTERPRET else 1
    kv_write_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, k_cache, v_cache, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_T=block_t,
        num_warps=4,
    )
