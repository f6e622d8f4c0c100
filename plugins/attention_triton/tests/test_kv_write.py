"""The KV-write kernel: every token's K/V lands exactly in its named slot, nothing else changes."""

import pytest
import torch
from triton_attn_cases import NAN, make_spec

from corerun_attention_triton.backend import TritonAttentionBackend


@pytest.mark.parametrize(
    "dtype, num_kv_heads, head_size, block_size",
    [(torch.float32, 2, 64, 16), (torch.bfloat16, 3, 80, 32), (torch.float16, 1, 128, 128)],
    ids=["fp32-kv2-hd64-bs16", "bf16-kv3-hd80-bs32", "fp16-kv1-hd128-bs128"],
)
def test_writes_land_in_named_slots_only(dtype, num_kv_heads, head_size, block_size):
    spec = make_spec(num_heads=num_kv_heads * 2, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
                     block_size=block_size)
    backend = TritonAttentionBackend(spec)
    gen = torch.Generator().manual_seed(7)
    num_blocks, num_tokens = 4, 45  # more tokens than one interpreter program takes
    cache = backend.allocate_kv_cache(num_blocks)
    k_view, v_view = backend.kv_cache_view(cache)
    k_view.fill_(NAN)
    v_view.fill_(NAN)

    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[3, 17, 44]] = -1  # padding tokens write nowhere
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_size, generator=gen).to(dtype)
    key, value = fused[:, :num_kv_heads], fused[:, 2 * num_kv_heads :]  # strided views

    expected_k = torch.full((num_blocks * block_size, num_kv_heads, head_size), NAN, dtype=torch.float64)
    expected_v = expected_k.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected_k[s] = key[t].double()
            expected_v[s] = value[t].double()

    backend.write_kv(key, value, cache, slots)

    got_k = k_view.reshape(-1, num_kv_heads, head_size).double()
    got_v = v_view.reshape(-1, num_kv_heads, head_size).double()
    torch.testing.assert_close(got_k, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got_v, expected_v, rtol=0, atol=0, equal_nan=True)


def test_cache_views_are_canonical_and_share_storage():
    spec = make_spec(num_kv_heads=2, head_size=64, block_size=16)
    backend = TritonAttentionBackend(spec)
    cache = backend.allocate_kv_cache(5)
    k, v = backend.kv_cache_view(cache)
    assert k.shape == v.shape == (5, 16, 2, 64)
    assert cache.numel() * cache.element_size() == 5 * backend.kv_cache_bytes_per_block()
    k[4, 15, 1, 63] = 3.0
    v[0, 0, 0, 0] = 5.0
    assert cache.flatten().tolist().count(3.0) == 1 and cache.flatten().tolist().count(5.0) == 1
    with pytest.raises(ValueError, match=r"\[2, num_blocks, 16, 2, 64\]"):
        backend.kv_cache_view(torch.zeros(5, 16, 2, 64))
