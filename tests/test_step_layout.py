"""The one step layout (corerun.protocols.step_layout): everything that lays out a step agrees with it.

STEP_FIELDS is the single description of a step's arrays.  These tests check that each consumer
follows it, field by field, so that a field added there and forgotten elsewhere fails here: the
runner's staging buffer (StepInputs), the CUDA-graph runner's static
inputs, and the plain builder (requests_step) the profile, tests and conformance suites use.  Values
are random and buffers are poisoned first, so an element a consumer does not carry shows.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from corerun.core.batch import NewRequest, ScheduledBatch
from corerun.graph.static_inputs import StaticDecodeInputs
from corerun.protocols.attention import AttentionBatch
from corerun.protocols.graph import GraphLimits, ModelInputs
from corerun.protocols.step_layout import (
    ALIGN, BLOCK_TABLE, STEP_FIELDS, StepLayout, StepTensors, model_inputs, requests_step, step_tensors,
)
from corerun.runner.input_batch import InputBatch
from corerun.runner.step_inputs import StepInputs
from corerun.sampling_params import SamplingParams

DIMS = [(1, 1, 1), (5, 3, 2), (7, 1, 9), (64, 64, 33), (513, 2, 40), (3, 2, 0)]


def random_fields(gen: torch.Generator, num_tokens: int, num_reqs: int, width: int) -> list[torch.Tensor]:
    """Every field at its described dtype and shape, filled with random values over the dtype's whole range."""
    out = []
    for f in STEP_FIELDS:
        info = torch.iinfo(f.dtype)
        out.append(torch.randint(info.min, info.max, f.shape(num_tokens, num_reqs, width), dtype=f.dtype, generator=gen))
    return out


def random_inputs(gen: torch.Generator, num_tokens: int, num_reqs: int, width: int) -> ModelInputs:
    return model_inputs(
        StepTensors._make(random_fields(gen, num_tokens, num_reqs, width)),
        max_query_len=num_tokens, max_seq_len=10 * num_tokens + 3, num_decodes=num_reqs // 2,
        query_start_loc_cpu=torch.arange(num_reqs + 1, dtype=torch.int32), seq_lens_cpu=torch.ones(num_reqs, dtype=torch.int32),
    )


def test_the_description_names_every_tensor_of_a_step_once():
    """Each field is an attribute of AttentionBatch (on_batch) or ModelInputs, and every per-step tensor of
    those two (the host copies aside) is a field: nothing is laid out that the model does not get, or the reverse."""
    batch_tensors = {f.name for f in dataclasses.fields(AttentionBatch) if "Tensor" in str(f.type) and not f.name.endswith("_cpu")}
    input_tensors = {f.name for f in dataclasses.fields(ModelInputs) if "Tensor" in str(f.type)}
    assert {f.name for f in STEP_FIELDS if f.on_batch} == batch_tensors
    assert {f.name for f in STEP_FIELDS if not f.on_batch} == input_tensors
    assert len({f.name for f in STEP_FIELDS}) == len(STEP_FIELDS)


@pytest.mark.parametrize("dims", DIMS)
def test_the_byte_layout_places_each_field_aligned_and_apart(dims):
    lay = StepLayout.of(*dims)
    spans = []
    for f, offset, size in zip(STEP_FIELDS, lay.offsets, lay.sizes):
        assert offset % ALIGN == 0, f.name
        assert size == int(np.prod(f.shape(*dims))) * f.dtype.itemsize, f.name
        spans.append((offset, offset + size))
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))  # in order, no overlap
    assert spans[-1][1] <= lay.nbytes and lay.nbytes % ALIGN == 0 and lay.nbytes - spans[-1][1] < ALIGN
    staged = torch.zeros(lay.nbytes, dtype=torch.uint8)
    for f, offset, view in zip(STEP_FIELDS, lay.offsets, lay.tensors(staged)):
        assert tuple(view.shape) == f.shape(*dims), f.name
        assert view.numel() == 0 or view.data_ptr() - staged.data_ptr() == offset, f.name  # (an empty view has no address)


def test_a_layout_of_negative_counts_is_refused_by_name():
    with pytest.raises(ValueError, match=r"num_reqs=-1"):
        StepLayout.of(3, -1, 2)


def test_the_staging_buffer_holds_each_field_where_the_layout_says():
    """A step through StepInputs into a poisoned buffer: the bytes at each field's offset are the tensor handed out."""
    rng = random.Random(5)
    bs, num_reqs = 16, 6
    si = StepInputs(bs, "cpu", max_num_tokens=256, max_num_reqs=8, max_blocks_per_seq=8)
    reqs, num_new, tables = [], [], {}
    for i in range(num_reqs):
        prompt = rng.randrange(2, 40)
        tables[i] = [rng.choice((0, 1, rng.randrange(2**20))) for _ in range(-(-prompt // bs))]  # block 0 anywhere
        computed = rng.randrange(0, prompt)
        reqs.append(NewRequest(i, tuple(rng.randrange(1000) for _ in range(prompt)), (), SamplingParams(max_tokens=4),
                               tuple(tables[i]), computed))
        num_new.append(prompt - computed)
    order = sorted(range(num_reqs), key=lambda i: num_new[i] != 1)
    sched = ScheduledBatch(tuple(order), tuple(num_new[i] for i in order), sum(n == 1 for n in num_new), tuple(reqs))
    batch = InputBatch(bs)
    batch.apply(sched)
    staged_bytes = si._buffers[0].host_np  # (the buffer the first step fills)
    staged_bytes.fill(0xA5)
    inputs, _, _ = si.build(sched, batch)
    dims = (sum(num_new), num_reqs, max(len(t) for t in tables.values()))
    lay = StepLayout.of(*dims)
    for f, offset, have in zip(STEP_FIELDS, lay.offsets, step_tensors(inputs)):
        assert have.dtype == f.dtype and tuple(have.shape) == f.shape(*dims), f.name
        staged = torch.from_numpy(staged_bytes[offset : offset + have.numel() * f.dtype.itemsize].copy()).view(f.dtype)
        assert torch.equal(staged, have.reshape(-1)), f.name
    want_slots = [tables[i][p // bs] * bs + p % bs
                  for i in order for p in range(reqs[i].num_computed_tokens, reqs[i].num_computed_tokens + num_new[i])]
    assert inputs.batch.slot_mapping.tolist() == want_slots


def test_graph_static_inputs_follow_the_description_and_carry_every_field():
    limits = GraphLimits(max_batch_size=8, max_model_len=80, block_size=16, hidden_size=4, dtype=torch.float32, device=torch.device("cpu"))
    static = StaticDecodeInputs(limits)
    width = 5  # ceil(80 / 16)
    for f, t in zip(STEP_FIELDS, static.fields):
        assert t.dtype == f.dtype and tuple(t.shape) == f.shape(8, 8, width), f.name
        assert getattr(static, f.name) is t
    gen = torch.Generator().manual_seed(3)
    for t in static.fields:  # poison: whatever load does not write or reset shows
        t.copy_(torch.randint(-(2**30), 2**30, t.shape, generator=gen, dtype=t.dtype))
    static.query_start_loc.copy_(torch.arange(9, dtype=torch.int32))  # (a pure decode's, never reloaded)
    static._real_rows, static._real_cols = 8, width  # as if a full-width step of 8 had been loaded
    for n, w in [(6, 4), (3, 2), (5, 5)]:
        step = random_inputs(gen, n, n, w)
        step.batch.query_start_loc.copy_(torch.arange(n + 1, dtype=torch.int32))
        static.load(step)
        view = static.inputs(n)
        for f, want, have, full in zip(STEP_FIELDS, step_tensors(step), step_tensors(view), static.fields):
            assert tuple(have.shape) == f.shape(n, n, width), f.name
            if f.extent == BLOCK_TABLE:
                assert torch.equal(have[:, :w], want) and bool((have[:, w:] == f.pad).all()), f.name
            else:
                assert torch.equal(have, want), f.name
            if f.pad is not None:  # rows past n are padding rows
                assert bool((full[n:] == f.pad).all()), f.name
        assert (view.batch.num_reqs, view.batch.num_tokens, view.batch.num_decodes) == (n, n, n)


def test_requests_step_matches_a_hand_worked_step():
    """Two decodes then a prefill chunk, block size 4, plus one padding row: every field written out by hand."""
    inputs = requests_step([5, 0, 3], [1, 1, 4], [[7, 2], [9], [4, 6]], 4, input_ids=[11, 12, 13, 14, 15, 16], num_padding=0)
    b = inputs.batch
    assert inputs.input_ids.tolist() == [11, 12, 13, 14, 15, 16]
    assert inputs.positions.tolist() == [5, 0, 3, 4, 5, 6]
    # slot = table[p // 4] * 4 + p % 4: 2*4+1, 9*4+0, 4*4+3, 6*4+0, 6*4+1, 6*4+2
    assert b.slot_mapping.tolist() == [9, 36, 19, 24, 25, 26]
    assert b.query_start_loc.tolist() == [0, 1, 2, 6]
    assert b.seq_lens.tolist() == [6, 1, 7] and b.context_lens.tolist() == [5, 0, 3]
    assert b.block_tables.tolist() == [[7, 2], [9, 0], [4, 6]]
    assert (b.num_tokens, b.num_reqs, b.max_query_len, b.max_seq_len, b.num_decodes) == (6, 3, 4, 7, 2)
    padded = requests_step([5, 0], [1, 1], [[7, 2], [9]], 4, num_padding=2, max_seq_len=64).batch
    assert padded.slot_mapping.tolist() == [9, 36, -1, -1]
    assert padded.seq_lens.tolist() == [6, 1, 1, 1] and padded.context_lens.tolist() == [5, 0, 0, 0]
    assert padded.query_start_loc.tolist() == [0, 1, 2, 3, 4] and padded.block_tables.tolist()[2:] == [[0, 0], [0, 0]]
    assert (padded.num_reqs, padded.num_decodes, padded.max_seq_len) == (4, 4, 64)


def test_requests_step_refuses_what_no_runner_would_build_by_name():
    with pytest.raises(ValueError, match=r"decodes \(query length 1\) must come first, got query_lens=\[3, 1\]"):
        requests_step([0, 4], [3, 1], [[1], [2, 3]], 4)
    with pytest.raises(ValueError, match=r"padding rows are decodes"):
        requests_step([0], [3], [[1]], 4, num_padding=1)
    with pytest.raises(ValueError, match=r"request 1's block table has 1 blocks, but its 4 \+ 1 tokens need 2 blocks of 4"):
        requests_step([3, 4], [1, 1], [[1], [2]], 4)
    with pytest.raises(ValueError, match=r"input_ids has 2 tokens, but the query lengths add up to 3"):
        requests_step([0], [3], [[1]], 4, input_ids=[1, 2])
