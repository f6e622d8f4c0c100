"""Loading one tile of K and V from the paged cache: shared by the unified and split-KV kernels.

Positions ``pos`` (int ``[TILE_N]``) of one request are mapped through its block-table row to
``(block, slot)``; masked positions (``pos_ok`` false) and padded head dimensions (``d_ok`` false)
read 0.  K comes back transposed for ``q @ k``; V as rows for ``p @ v``.
"""

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    k_cache_ptr, v_cache_ptr, block_row, pos, pos_ok, offs_d, d_ok, kv_head,
    stride_kc_blk, stride_kc_slot, stride_kc_head, stride_vc_blk, stride_vc_slot, stride_vc_head,
    BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr,
):
    """-> ``k`` ``[HEAD_PAD, TILE_N]``, ``v`` ``[TILE_N, HEAD_PAD]`` (float32 when ``UPCAST``)."""
    block = tl.load(block_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    slot = pos % BLOCK_SIZE
    k = tl.load(
        k_cache_ptr + block[None, :] * stride_kc_blk + slot[None, :] * stride_kc_slot
        + kv_head * stride_kc_head + offs_d[:, None],
        mask=d_ok[:, None] & pos_ok[None, :],
        other=0.0,
    )
    v = tl.load(
        v_cache_ptr + block[:, None] * stride_vc_blk + slot[:, None] * stride_vc_slot
        + kv_head * stride_vc_head + offs_d[None, :],
        mask=pos_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v
