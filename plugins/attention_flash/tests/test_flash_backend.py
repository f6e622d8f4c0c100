"""The ``flash`` backend's argument plumbing, on CPU, against the flash-attn emulator and a float64 reference.

Every step starts from a cache poisoned with NaN (except the cached prefixes) and an output poisoned
with NaN, so a token not written, a slot read past a sequence's end, or an output row left unwritten
fails the comparison.  Each case runs through FA2 (``flash_attn``: ``flash_attn_varlen_func`` +
``flash_attn_with_kvcache`` with ``block_table``) and FA3 (``flash_attn_interface``:
``flash_attn_with_kvcache`` with ``page_table``), in float64 (emulation only, 1e-10) and in the
float16 / bfloat16 flash-attn really takes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from corerun_attention_flash.backend import FlashAttentionBackend
from corerun_attention_flash.metadata import FlashDecodeMetadata, FlashVarlenMetadata
from corerun_attention_flash.testing import emulated

LIBRARIES = ["flash_attn", "flash_attn_interface"]

# name: (context_lens, query_lens, num_decodes, num_padding, shuffle); block size 256
CASES = {
    "prefill": ([0, 0, 0], [5, 300, 17], 0, 0, False),
    "prefill-cached-prefix": ([256, 10, 300], [3, 260, 40], 0, 0, True),
    "decode-ragged-padded": ([0, 254, 255, 256, 600], [1, 1, 1, 1, 1], 5, 2, True),
    "mixed": ([7, 255, 0, 512], [1, 1, 70, 300], 2, 0, True),
    "block-boundaries": ([255, 256, 511, 0], [1, 256, 2, 256], 1, 0, True),
}


@pytest.fixture(params=LIBRARIES)
def library(request):
    return request.param


# every case in float64 (emulation only: the plumbing at 1e-10); the mixed and decode cases also in
# the two dtypes flash-attn really takes
DTYPE_CASES = [(torch.float64, case) for case in CASES] + [
    (dtype, case) for dtype in (torch.float16, torch.bfloat16) for case in ("mixed", "decode-ragged-padded")
]


@pytest.mark.parametrize("dtype, case", DTYPE_CASES, ids=[f"{c}-{str(d).removeprefix('torch.')}" for d, c in DTYPE_CASES])
def test_matches_reference(cases, library, dtype, case):
    context_lens, query_lens, num_decodes, num_padding, shuffle = CASES[case]
    with emulated(library, allow_float64=True) as flash:
        backend = flash.create(cases.make_spec(dtype=dtype))
        step = cases.make_step(backend, context_lens, query_lens, num_decodes=num_decodes, num_padding=num_padding, shuffle=shuffle)
        out = cases.run_step(backend, step)
    cases.check_step(backend, step, out)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=["MHA", "GQA4", "MQA"])
def test_grouped_query_attention(cases, library, heads):
    num_heads, num_kv_heads = heads
    with emulated(library, allow_float64=True) as flash:
        backend = flash.create(cases.make_spec(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=16))
        for decode in (True, False):
            ctx, ql, nd = ([3, 300], [1, 1], 2) if decode else ([3, 300], [1, 20], 1)
            step = cases.make_step(backend, ctx, ql, num_decodes=nd, seed=num_heads)
            cases.check_step(backend, step, cases.run_step(backend, step))


def test_softmax_scale_and_head_size_256(cases, library):
    with emulated(library, allow_float64=True) as flash:
        backend = flash.create(cases.make_spec(num_heads=2, num_kv_heads=1, head_size=256, scale=0.37))
        for ctx, ql, nd in (([5, 260], [1, 1], 2), ([5, 260], [1, 9], 1)):
            step = cases.make_step(backend, ctx, ql, num_decodes=nd, seed=3)
            cases.check_step(backend, step, cases.run_step(backend, step))


def test_returns_new_tensor_without_out(cases, library):
    with emulated(library, allow_float64=True) as flash:
        backend = flash.create(cases.make_spec())
        step = cases.make_step(backend, [4, 0], [1, 7], num_decodes=1)
        result = backend.forward(step.query, step.key, step.value, step.kv_cache, backend.plan(step.batch))
    assert result.shape == step.query.shape and result.dtype == step.query.dtype
    assert cases.relative_error(result, step.expected) < 1e-10


def test_decode_plan_references_batch_tensors_and_replays(cases, library):
    """CUDA-graph contract: a decode plan holds the batch's own tensors, so new values written into them are seen."""
    with emulated(library, allow_float64=True) as flash:
        backend = flash.create(cases.make_spec())
        first = cases.make_step(backend, [10, 300, 40], [1, 1, 1], num_decodes=3, seed=1)
        plan = backend.plan(first.batch)
        assert isinstance(plan, FlashDecodeMetadata)
        assert plan.cache_seqlens is first.batch.seq_lens
        assert plan.block_table is first.batch.block_tables
        assert plan.slot_mapping is first.batch.slot_mapping
        second = cases.make_step(backend, [256, 2, 511], [1, 1, 1], num_decodes=3, seed=2)
        b1, b2 = first.batch, second.batch
        b1.seq_lens.copy_(b2.seq_lens)
        b1.slot_mapping.copy_(b2.slot_mapping)
        b1.block_tables.copy_(b2.block_tables)
        out = cases.run_step(backend, second, plan=plan)
    cases.check_step(backend, second, out)


def test_varlen_plan_cumulates_seq_lens(cases):
    with emulated(allow_float64=True) as flash:
        backend = flash.create(cases.make_spec())
        step = cases.make_step(backend, [5, 0, 300], [1, 9, 4], num_decodes=1)
        plan = backend.plan(step.batch)
    assert isinstance(plan, FlashVarlenMetadata)
    assert plan.cu_seqlens_k.tolist() == [0, 6, 15, 319] and plan.cu_seqlens_k.dtype == torch.int32
    assert plan.cu_seqlens_q is step.batch.query_start_loc
    assert (plan.max_seqlen_q, plan.max_seqlen_k) == (9, 304)


def test_plan_rejects_non_int32_block_tables(cases):
    with emulated(allow_float64=True) as flash:
        backend = flash.create(cases.make_spec())
        step = cases.make_step(backend, [0], [3])
        step.batch.block_tables = step.batch.block_tables.long()
        with pytest.raises(ValueError, match="block_tables must be int32"):
            backend.plan(step.batch)


def test_fa3_serves_small_pages_when_declared(cases, monkeypatch):
    """FA3 reads pages of any size; with the declaration widened, block size 16 works through FA3."""
    caps = dataclasses.replace(FlashAttentionBackend.capabilities, block_sizes=None)
    monkeypatch.setattr(FlashAttentionBackend, "capabilities", caps)
    with emulated("flash_attn_interface", allow_float64=True) as flash:
        backend = flash.create(cases.make_spec(block_size=16))
        for ctx, ql, nd in (([15, 16, 33], [1, 1, 1], 3), ([15, 16, 0], [1, 20, 35], 1)):
            step = cases.make_step(backend, ctx, ql, num_decodes=nd, seed=7)
            cases.check_step(backend, step, cases.run_step(backend, step))


def test_fa2_refuses_small_pages_at_construction_even_if_declared(cases, monkeypatch):
    """Were the declaration widened for FA3, an FA2 install still fails at startup with the reason."""
    caps = dataclasses.replace(FlashAttentionBackend.capabilities, block_sizes=None)
    monkeypatch.setattr(FlashAttentionBackend, "capabilities", caps)
    from corerun.errors import UnsupportedError

    with emulated("flash_attn") as flash:
        with pytest.raises(UnsupportedError, match=r"multiple of 256 tokens, got kv_cache.block_size 16; use kv_cache.block_size 256"):
            flash.create(cases.make_spec(dtype=torch.float16, block_size=16))
