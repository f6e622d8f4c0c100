"""Split-KV decoding: the shape-only rule, the forced path against the reference, and graph-style replay."""

import pytest
import torch
from triton_attn_cases import build_case, make_spec, run_and_check

from corerun_attention_triton.backend import TritonAttentionBackend
from corerun_attention_triton.split_rule import MAX_SPLITS, SPLIT_MIN_SEQ_LEN, choose_num_splits

LONG_DECODES = [(c, 1) for c in (0, 63, 64, 200, 301)]  # 1..5 tiles of 64 keys over 4 slices: empty slices too


def test_rule_splits_only_small_decode_batches_over_long_bounds():
    h200 = 132
    assert choose_num_splits(1, 8, 32768, h200) == 32  # 8 programs -> aim for 264: 33, pow2 floor
    assert choose_num_splits(8, 8, 32768, h200) == 4  # 64 programs -> 5 -> 4
    assert choose_num_splits(32, 8, 32768, h200) == 1  # 256 programs already fill 132 SMs
    assert choose_num_splits(1, 8, SPLIT_MIN_SEQ_LEN - 1, h200) == 1  # short bound: never
    assert choose_num_splits(1, 1, 2048, h200) == 8  # at least 256 keys per slice at the bound
    assert choose_num_splits(1, 1, 10**7, 10**4) == MAX_SPLITS
    assert choose_num_splits(0, 8, 32768, h200) == 1  # no decodes
    assert choose_num_splits(1, 8, 32768, None) == 1  # the interpreter runs programs in sequence


def test_plan_is_graph_safe_and_depends_on_shapes_only():
    backend = TritonAttentionBackend(make_spec())
    backend.num_sms = 132  # as on an H200: lets the rule split
    case = build_case(backend, [(c, 1) for c in (3, 900)], max_seq_len=4096)
    other = build_case(backend, [(c, 1) for c in (2000, 7)], seed=9, max_seq_len=4096)
    plan, other_plan = backend.plan(case.batch), backend.plan(other.batch)
    # The plan only references the batch's tensors (no copies) ...
    assert plan.query_start_loc is case.batch.query_start_loc
    assert plan.seq_lens is case.batch.seq_lens
    assert plan.block_tables is case.batch.block_tables
    assert plan.slot_mapping is case.batch.slot_mapping
    # ... and its launch choices do not depend on the sequence lengths behind the same shapes.
    keep = ("num_splits", "block_m", "block_q", "tile_n", "autotune", "num_reqs", "num_tokens", "num_decodes")
    assert {k: getattr(plan, k) for k in keep} == {k: getattr(other_plan, k) for k in keep}
    assert plan.num_splits == 16 and not plan.autotune


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forced_split_decodes_match_reference(dtype):
    backend = TritonAttentionBackend(make_spec(num_heads=6, num_kv_heads=2, dtype=dtype), num_splits=4)
    case = build_case(backend, LONG_DECODES, seed=1)
    assert backend.plan(case.batch).split_decodes
    run_and_check(backend, case)


def test_forced_split_in_mixed_batch_and_with_padding_rows():
    backend = TritonAttentionBackend(make_spec(), num_splits=3)  # not a power of two
    mixed = build_case(backend, [(130, 1), (64, 1), (5, 9), (31, 17)], seed=2)
    plan = backend.plan(mixed.batch)
    assert plan.split_decodes and plan.num_decodes == 2
    run_and_check(backend, mixed, plan)  # decodes split, prefills unified, one output
    run_and_check(backend, build_case(backend, [(130, 1), (64, 1)], pad_rows=2, seed=3))


@pytest.mark.parametrize("num_splits", [1, 4], ids=["unified", "split"])
def test_replay_with_a_plan_made_for_other_contents(num_splits):
    """What a CUDA-graph replay does: reuse the capture-time plan after new values are written into
    the same batch tensors (capture planned with the max_seq_len bound, not the real lengths)."""
    backend = TritonAttentionBackend(make_spec(), num_splits=num_splits)
    capture = build_case(backend, [(0, 1), (5, 1), (0, 1)], seed=4, max_seq_len=256, table_width=16)
    replay = build_case(backend, [(190, 1), (63, 1), (64, 1)], seed=5, max_seq_len=256)
    plan = backend.plan(capture.batch)
    b, new = capture.batch, replay.batch
    for name in ("query_start_loc", "seq_lens", "context_lens", "slot_mapping"):
        getattr(b, name).copy_(getattr(new, name))
    b.block_tables.zero_()
    b.block_tables[:, : new.block_tables.shape[1]] = new.block_tables
    replay.batch = b  # the reference reads the (now rewritten) capture-time tensors
    run_and_check(backend, replay, plan)
