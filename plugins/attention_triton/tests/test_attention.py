"""The unified kernel against the float64 reference: prefill, cached prefixes, decodes, mixed batches.

Every case runs over a NaN-poisoned cache with shuffled block tables, into a NaN-poisoned output,
and also checks the cache after the step's writes bit for bit (see ``triton_attn_cases``).
"""

import dataclasses

import pytest
import torch
from triton_attn_cases import build_case, make_spec, run_and_check

from corerun_attention_triton.backend import TritonAttentionBackend

# (context_len, query_len) per request, decodes first.
MIXED = [(0, 1), (16, 1), (40, 1), (0, 7), (17, 15), (33, 20)]


def check(reqs, pad_rows=0, num_splits=1, **spec_kw):
    backend = TritonAttentionBackend(make_spec(**spec_kw), num_splits=num_splits)
    return run_and_check(backend, build_case(backend, reqs, pad_rows=pad_rows, seed=len(reqs)))


def test_prefill_without_prefix():
    check([(0, 7), (0, 19), (0, 33)])


def test_prefill_with_cached_prefix():
    check([(5, 3), (16, 5), (33, 20), (70, 2)])


def test_prefill_chunks_ending_on_and_one_past_block_boundaries():
    # seq_len 32 = two full blocks; 33 = one past; 48 = three full blocks; a chunk starting on a boundary.
    check([(16, 16), (17, 16), (31, 17), (32, 16)])


def test_decodes_over_ragged_contexts_and_block_boundaries():
    # seq_lens 1, 16, 17, 32, 33, 48, 64, 65, 100: on and one past block boundaries.
    check([(c, 1) for c in (0, 15, 16, 31, 32, 47, 63, 64, 99)])


def test_cuda_graph_padding_rows_write_nothing():
    # Padding decodes (seq_len 1, context 0, slot -1, block-table row of zeros) must leave the cache
    # untouched (checked bit for bit) while the real rows stay exact.
    check([(9, 1), (40, 1)], pad_rows=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_mixed_batch_dtypes(dtype):
    check(MIXED, dtype=dtype)


@pytest.mark.parametrize(
    "num_heads, num_kv_heads",
    [(4, 4), (6, 2), (8, 1), (32, 2)],
    ids=["mha", "gqa3-non-pow2", "mqa8", "gqa16-one-token-per-tile"],
)
def test_mixed_batch_grouped_query_attention(num_heads, num_kv_heads):
    check(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=32)


@pytest.mark.parametrize(
    "head_size, block_size, dtype",
    [(80, 32, torch.bfloat16), (96, 64, torch.float16), (256, 128, torch.float32), (128, 16, torch.float16)],
    ids=["hd80-bs32-bf16", "hd96-bs64-fp16", "hd256-bs128-fp32", "hd128-bs16-fp16"],
)
def test_head_and_block_sizes(head_size, block_size, dtype):
    check([(0, 1), (130, 1), (5, 9), (127, 3)], head_size=head_size, block_size=block_size, dtype=dtype)


def test_custom_softmax_scale():
    backend = TritonAttentionBackend(dataclasses.replace(make_spec(), scale=0.3))
    run_and_check(backend, build_case(backend, MIXED, seed=3))


def test_out_none_allocates_and_matches():
    backend = TritonAttentionBackend(make_spec())
    case = build_case(backend, MIXED, seed=4)
    out = backend.forward(case.query, case.key, case.value, case.kv_cache, backend.plan(case.batch))
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    assert not out.isnan().any()


def test_wrong_input_shapes_are_named():
    backend = TritonAttentionBackend(make_spec())
    case = build_case(backend, [(0, 2)], seed=5)
    meta = backend.plan(case.batch)
    with pytest.raises(ValueError, match=r"query must be \[num_tokens, 4, 64\] float32, got \[2, 256\]"):
        backend.forward(case.query.reshape(2, -1), case.key, case.value, case.kv_cache, meta)
    with pytest.raises(ValueError, match=r"key must be .* float32, got \[2, 2, 64\] float16"):
        backend.forward(case.query, case.key.half(), case.value, case.kv_cache, meta)
