"""Step-input preparation (corerun.runner.step_inputs, ModelRunner.prepare_inputs) against a per-token reference.

The reference below is written independently, the straightforward way: Python loops over the
scheduled sequences and their tokens.  Random batches cover decodes only, prefills only, prompt
chunks that stop mid-prompt, mixes, batch 1 and ragged block tables.  The staging buffer is
poisoned before each step, and consecutive steps change shape, so an element left unwritten, a stale
tail or a too-short buffer would show.

Block tables are kept across steps (``BlockRows``) and follow the changes each batch states
(``ScheduledBatch.new_block_ids`` / ``finished_ids``, protocol version 2), as the scheduler hands
them out.  Multi-step runs below drive sequences through growth across block boundaries, preemption
and re-admission (tables rewritten at the same length included), trims, finishing and eviction,
against the same reference, and count the calls to ``block_table`` (none while every change is stated).
"""

from __future__ import annotations

import collections
import itertools
import random
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import pytest
import torch

from corerun.core.scheduler import BlockIds, ScheduledBatch
from corerun.core.sequence import Sequence
from corerun.sampling_params import SamplingParams
from corerun.protocols.step_layout import ALIGN, StepLayout
from corerun.runner import step_inputs
from corerun.runner.step_inputs import BlockRows, StepInputs

BS = 16
KINDS = ("decode", "prefill", "chunk", "mixed")
INT64 = ("input_ids", "positions", "slot_mapping")


# ----------------------------------------------------------------------------- the reference
def reference(sched: ScheduledBatch, tables: dict[int, list[int]], bs: int) -> dict[str, Any]:
    """Every prepared value, built token by token in Python lists."""
    ref: dict[str, Any] = {k: [] for k in ("input_ids", "positions", "slot_mapping", "seq_lens", "context_lens",
                                           "rows", "logits_indices")}
    ref["query_start_loc"] = [0]
    for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_new)):
        start = seq.num_computed_tokens
        table = tables[seq.seq_id]
        for pos in range(start, start + n):
            ref["input_ids"].append(seq.token_ids[pos])
            ref["positions"].append(pos)
            ref["slot_mapping"].append(table[pos // bs] * bs + pos % bs)
        ref["query_start_loc"].append(ref["query_start_loc"][-1] + n)
        ref["seq_lens"].append(start + n)
        ref["context_lens"].append(start)
        if start + n == len(seq.token_ids):
            ref["rows"].append(i)
            ref["logits_indices"].append(ref["query_start_loc"][-1] - 1)
    width = max(len(tables[s.seq_id]) for s in sched.seqs)
    ref["block_tables"] = [tables[s.seq_id] + [0] * (width - len(tables[s.seq_id])) for s in sched.seqs]
    ref["max_query_len"] = max(sched.num_new)
    ref["max_seq_len"] = max(ref["seq_lens"])
    return ref


def snapshot(out: tuple[Any, np.ndarray, np.ndarray]) -> dict[str, Any]:
    """What a step handed out, as plain Python values (copied now)."""
    inputs, rows, logits_indices = out
    b = inputs.batch
    tensors = {"input_ids": inputs.input_ids, "positions": inputs.positions, "slot_mapping": b.slot_mapping,
               "query_start_loc": b.query_start_loc, "seq_lens": b.seq_lens, "context_lens": b.context_lens,
               "block_tables": b.block_tables, "query_start_loc_cpu": b.query_start_loc_cpu, "seq_lens_cpu": b.seq_lens_cpu}
    snap: dict[str, Any] = {k: (v.dtype, v.device.type, v.tolist()) for k, v in tensors.items()}
    snap["rows"] = (rows.dtype, rows.tolist())
    snap["logits_indices"] = (logits_indices.dtype, logits_indices.tolist())
    snap["host"] = (b.num_reqs, b.num_tokens, b.max_query_len, b.max_seq_len, b.num_decodes)
    return snap


def check(out: tuple[Any, np.ndarray, np.ndarray], sched: ScheduledBatch, tables: dict[int, list[int]], bs: int = BS) -> dict[str, Any]:
    """Assert ``out`` equals the reference (values, dtypes, device); return its snapshot."""
    ref, snap = reference(sched, tables, bs), snapshot(out)
    for key in INT64 + ("query_start_loc", "seq_lens", "context_lens", "block_tables"):
        dtype, device, values = snap[key]
        assert dtype == (torch.int64 if key in INT64 else torch.int32), (key, dtype)
        assert device == "cpu" and values == ref[key], (key, values, ref[key])
    for key, ref_key in (("query_start_loc_cpu", "query_start_loc"), ("seq_lens_cpu", "seq_lens")):
        assert snap[key] == (torch.int32, "cpu", ref[ref_key]), key
    assert snap["rows"] == (np.int64, ref["rows"]) and snap["logits_indices"] == (np.int64, ref["logits_indices"])
    assert not np.shares_memory(out[1], out[2])
    num_decodes = sum(1 for n in sched.num_new if n == 1)
    assert snap["host"] == (len(sched.seqs), len(ref["input_ids"]), ref["max_query_len"], ref["max_seq_len"], num_decodes)
    assert out[0].batch.block_tables.shape == (len(sched.seqs), len(ref["block_tables"][0]))
    return snap


# ----------------------------------------------------------------------------- random steps
def random_step(rng: random.Random, kind: str, num_seqs: int, first_id: int = 0, max_extra_blocks: int = 2,
                max_prompt: int = 80) -> tuple[ScheduledBatch, dict[int, list[int]]]:
    """A batch of ``kind`` with decodes first (as the scheduler orders it), and each sequence's block table.

    Tables have the blocks the step needs plus up to ``max_extra_blocks`` more (ragged widths); block
    ids reach 2**30, so that ``block * block_size`` only fits int64.
    """
    seqs, num_new, tables = [], [], {}
    for k in range(num_seqs):
        sid = first_id + k
        prompt = [rng.randrange(1, 50_000) for _ in range(rng.randint(1, max_prompt))]
        seq = Sequence(seq_id=sid, request_id=str(sid), prompt_token_ids=prompt, params=SamplingParams(max_tokens=64))
        what = kind if kind != "mixed" else rng.choice(("decode", "prefill", "chunk"))
        if what == "decode":  # the prompt is in the cache, and some generated tokens
            seq.token_ids += [rng.randrange(50_000) for _ in range(rng.randint(1, 20))]
            seq.num_computed_tokens, n = seq.num_tokens - 1, 1
        elif what == "prefill":  # all of the prompt, or what is left of it after a cached prefix
            seq.num_computed_tokens = rng.choice((0, rng.randrange(len(prompt))))
            n = len(prompt) - seq.num_computed_tokens
        else:  # a chunk that stops before the prompt's end (not sampled); sometimes a 1-token chunk
            if len(prompt) < 3:
                prompt += [5, 6, 7]
                seq.token_ids += [5, 6, 7]
            seq.num_computed_tokens = rng.randrange(len(prompt) - 2)
            n = rng.choice((1, rng.randint(1, len(prompt) - 1 - seq.num_computed_tokens)))
        needed = -(-(seq.num_computed_tokens + n) // BS)
        tables[sid] = [rng.randrange(2**30) for _ in range(needed + rng.randint(0, max_extra_blocks))]
        seqs.append(seq)
        num_new.append(n)
    order = sorted(range(num_seqs), key=lambda i: num_new[i] != 1)
    seqs, num_new = [seqs[i] for i in order], [num_new[i] for i in order]
    return ScheduledBatch(seqs, num_new, sum(1 for n in num_new if n == 1), []), tables


def builder(**limits: int) -> StepInputs:
    return StepInputs(BS, "cpu", max_num_tokens=limits.get("tokens", 512), max_num_reqs=limits.get("reqs", 64),
                      max_blocks_per_seq=limits.get("blocks", 16))


def build(si: StepInputs, sched: ScheduledBatch, tables: dict[int, list[int]],
          block_table: Callable[[int], list[int]] | None = None) -> tuple[Any, np.ndarray, np.ndarray]:
    si._host_np.fill(0xA5)  # poison the staging buffer: an element the step does not write shows
    si._staged = None  # and forget what it held (a steady step rewrites only what changed; see the unpoisoned tests)
    return si.build(sched, block_table or tables.__getitem__)


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_seqs", [1, 3, 17])
def test_matches_the_per_token_reference(kind, num_seqs):
    rng = random.Random(f"{kind}-{num_seqs}")
    si = builder()
    for step in range(4):
        sched, tables = random_step(rng, kind, num_seqs, first_id=100 * step)
        check(build(si, sched, tables), sched, tables)


def test_every_row_full_width_and_every_row_ragged():
    rng = random.Random("ragged")
    si = builder()
    for extra in (0, 5):  # 0: tables exactly as long as needed, all one width; 5: ragged widths
        for k, kind in enumerate(KINDS):
            sched, tables = random_step(rng, kind, 6, first_id=100 * k + 1000 * extra, max_extra_blocks=extra, max_prompt=BS * 2)
            if extra == 0:  # the same number of blocks for every row
                width = max(len(t) for t in tables.values())
                tables = {sid: t + [rng.randrange(2**30) for _ in range(width - len(t))] for sid, t in tables.items()}
            check(build(si, sched, tables), sched, tables)


def test_consecutive_steps_of_changing_shapes_and_earlier_outputs_unchanged():
    """Big, small, wide, narrow steps through one builder; what each step handed out stays as it was."""
    rng = random.Random("shapes")
    si = builder()
    shapes = [("prefill", 12), ("decode", 1), ("mixed", 30), ("chunk", 2), ("decode", 40), ("prefill", 1), ("decode", 3)]
    kept = []
    for i, (kind, n) in enumerate(shapes):
        sched, tables = random_step(rng, kind, n, first_id=100 * i, max_extra_blocks=rng.choice((0, 6)))
        out = si.build(sched, tables.__getitem__)  # no poison here: the previous step's bytes are the stale tail
        kept.append((out, check(out, sched, tables)))
    for out, snap in kept:
        assert snapshot(out) == snap


def test_step_n_outputs_unchanged_after_step_n_plus_1_of_the_same_shape():
    """Same shape, new values: step N+1 writes the same staging bytes that step N's tensors came from."""
    rng = random.Random(7)
    si = builder()
    first, tables1 = random_step(rng, "decode", 4)
    out1 = si.build(first, tables1.__getitem__)
    snap1 = check(out1, first, tables1)
    for seq in first.seqs:  # the same sequences, preempted and back: new tables of the same length
        seq.num_computed_tokens += 1
        seq.token_ids.append(rng.randrange(50_000))
        seq.num_preemptions += 1
    tables2 = {sid: [rng.randrange(2**30) for _ in t] for sid, t in tables1.items()}
    first.new_block_ids = {sid: BlockIds(0, t) for sid, t in tables2.items()}  # what the scheduler states
    check(si.build(first, tables2.__getitem__), first, tables2)
    assert snapshot(out1) == snap1
    staging = (si._host_np.ctypes.data, si._host_np.ctypes.data + si.capacity)
    for t in (out1[0].input_ids, out1[0].batch.block_tables, out1[0].batch.query_start_loc_cpu, out1[0].batch.seq_lens_cpu):
        assert not staging[0] <= t.data_ptr() < staging[1], "a tensor handed out lives in the staging buffer"


def test_a_step_beyond_the_limits_grows_the_buffer():
    rng = random.Random(3)
    si = builder(tokens=4, reqs=1, blocks=1)
    before = si.capacity
    sched, tables = random_step(rng, "prefill", 20, max_prompt=200)
    check(build(si, sched, tables), sched, tables)
    assert si.capacity >= StepLayout.of(sched.num_tokens, 20, max(map(len, tables.values()))).nbytes > before
    small, small_tables = random_step(rng, "decode", 2, first_id=50)
    check(build(si, small, small_tables), small, small_tables)


def test_limits_size_the_buffer_once():
    si = builder(tokens=300, reqs=20, blocks=9)
    assert si.capacity == StepLayout.of(300, 20, 9).nbytes
    rng = random.Random(4)
    ptr = si._host_np.ctypes.data
    for k, kind in enumerate(KINDS):  # steps within the limits reuse the buffer
        sched, tables = random_step(rng, kind, 4, first_id=10 * k, max_prompt=60, max_extra_blocks=0)
        check(build(si, sched, tables), sched, tables)
    assert si._host_np.ctypes.data == ptr


def test_device_views_equal_host_views_and_fields_are_aligned():
    """``StepLayout.tensors`` (the CUDA path's views of the one copied tensor), checked here on a CPU tensor,
    against ``host_tensors`` and against the layout written out by hand."""
    rng = np.random.default_rng(0)
    for t, r, w in [(1, 1, 1), (7, 3, 5), (64, 64, 33), (513, 2, 40), (3, 1, 100)]:
        lay = StepLayout.of(t, r, w)
        staged = rng.integers(0, 256, lay.nbytes, dtype=np.uint8)
        dev = lay.tensors(torch.from_numpy(staged))
        host = lay.host_tensors(staged)
        base = staged.ctypes.data
        for d, h, dtype, shape in zip(dev, host, [torch.int64] * 3 + [torch.int32] * 4,
                                      [(t,), (t,), (t,), (r + 1,), (r,), (r,), (r, w)]):
            assert d.dtype == h.dtype == dtype and d.shape == h.shape == shape and d.is_contiguous()
            assert d.data_ptr() == h.data_ptr() and (d.data_ptr() - base) % ALIGN == 0
        if (t, r, w) == (7, 3, 5):  # offsets by hand: each field starts at the next multiple of 16 bytes
            hand = [0, 64, 128, 192, 208, 224, 240]  # 7x8 -> 64, 7x8 -> 128, 7x8 -> 192, 4x4 -> 208, 3x4 -> 224, 3x4 -> 240
            assert [d.data_ptr() - base for d in dev] == hand and lay.nbytes == 304  # + 3x5x4 = 300 -> 304
            for d, at in zip(dev, hand):
                want = np.frombuffer(staged.tobytes(), dtype=d.numpy().dtype, count=d.numel(), offset=at)
                assert np.array_equal(d.numpy().ravel(), want)


class RecordingFence:
    """A fence for CPU: remembers the staged bytes at ``record``; ``synchronize`` checks they are still there."""

    def __init__(self, si_ref: list[StepInputs]) -> None:
        self.si_ref, self.recorded, self.waits = si_ref, None, 0

    def record(self) -> None:
        self.recorded = self.si_ref[0]._host_np.copy()

    def synchronize(self) -> None:
        self.waits += 1
        assert np.array_equal(self.si_ref[0]._host_np, self.recorded), "the buffer was written before the wait"


def test_the_buffer_is_rewritten_only_after_waiting_for_the_previous_copy():
    rng = random.Random(5)
    ref: list[StepInputs] = []
    fence = RecordingFence(ref)
    si = StepInputs(BS, "cpu", max_num_tokens=256, max_num_reqs=32, max_blocks_per_seq=16, fence=fence)
    ref.append(si)
    sched, tables = random_step(rng, "mixed", 5)
    check(si.build(sched, tables.__getitem__), sched, tables)
    assert fence.waits == 0  # nothing was pending before the first step
    for k, kind in enumerate(("decode", "prefill", "mixed")):
        sched, tables = random_step(rng, kind, 5, first_id=10 * (k + 1))
        check(si.build(sched, tables.__getitem__), sched, tables)
    assert fence.waits == 3

    def broken(seq_id: int) -> list[int]:
        raise KeyError(seq_id)

    sched, _ = random_step(rng, "decode", 2, first_id=40)  # new sequences: their tables must be read
    with pytest.raises(KeyError):  # a step that fails before its copy leaves the previous copy pending
        si.build(sched, broken)
    sched, tables = random_step(rng, "decode", 2, first_id=50)
    check(si.build(sched, tables.__getitem__), sched, tables)
    assert fence.waits == 4


def test_refusals_say_what_was_wrong():
    si = builder()
    with pytest.raises(ValueError, match="empty scheduled batch"):
        si.build(ScheduledBatch([], [], 0, []), {}.__getitem__)
    with pytest.raises(ValueError, match="power of two.*got 12"):
        StepInputs(12, "cpu", max_num_tokens=8, max_num_reqs=2, max_blocks_per_seq=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging and the CUDA event need a GPU")
def test_cuda_pinned_staging_matches_the_reference():
    rng = random.Random(6)
    si = StepInputs(BS, "cuda", max_num_tokens=512, max_num_reqs=64, max_blocks_per_seq=16)
    assert si._host.is_pinned()
    kept = []
    for kind, n in [("prefill", 9), ("decode", 1), ("mixed", 20), ("decode", 40)]:
        sched, tables = random_step(rng, kind, n, first_id=len(kept) * 100)
        out = si.build(sched, tables.__getitem__)  # the next build reuses the buffer while this copy may be in flight
        assert out[0].input_ids.device.type == "cuda" and out[0].batch.query_start_loc_cpu.device.type == "cpu"
        kept.append((out, sched, tables))
    torch.cuda.synchronize()
    for out, sched, tables in kept:
        inputs = out[0]
        inputs.input_ids, inputs.positions = inputs.input_ids.cpu(), inputs.positions.cpu()
        b = inputs.batch
        for name in ("query_start_loc", "seq_lens", "context_lens", "block_tables", "slot_mapping"):
            setattr(b, name, getattr(b, name).cpu())
        check(out, sched, tables)


# ----------------------------------------------------------------------------- block tables kept across steps
class GrowOnlyTables:
    """Block tables as a KV-cache manager keeps them: grown at the end while held, new after ``free``,
    and the changes a scheduler states about them (``states_changes``): each table's new entries since
    the batch that last scheduled it, and the sequences finished since the previous batch.

    ``block_table`` returns a copy (as ``paged`` does) and records the seq_id it was asked for.
    """

    def __init__(self, rng: random.Random, states_changes: bool = True) -> None:
        self.rng = rng
        self.tables: dict[int, list[int]] = {}
        self.calls: list[int] = []
        self.states_changes = states_changes
        self.changes: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (start, entries from start on)
        self.finished: list[int] = []

    def _changed(self, seq_id: int, start: int) -> None:
        if self.states_changes:
            first = min(start, self.changes.get(seq_id, (start, []))[0])
            self.changes[seq_id] = (first, self.tables[seq_id][first:])

    def grow(self, seq_id: int, num_tokens: int, extra: int = 0) -> None:
        """Hold ``num_tokens`` tokens (a table made now gets ``extra`` blocks more than that)."""
        need = -(-num_tokens // BS)
        if seq_id not in self.tables:
            self.tables[seq_id], need = [], need + extra
        table = self.tables[seq_id]
        start = len(table)
        table += [self.rng.randrange(2**30) for _ in range(need - len(table))]
        if len(table) > start or not table:
            self._changed(seq_id, start)

    def trim(self, seq_id: int, num_blocks: int) -> None:
        if num_blocks < len(self.tables[seq_id]):
            del self.tables[seq_id][num_blocks:]
            self._changed(seq_id, num_blocks)

    def free(self, seq_id: int, finished: bool = False) -> None:
        del self.tables[seq_id]
        self.changes.pop(seq_id, None)
        if finished:
            self.finished.append(seq_id)

    def stated(self, seqs: list[Sequence]) -> tuple[dict[int, BlockIds], frozenset[int]]:
        """The changes a batch of ``seqs`` carries (handed out once)."""
        changes = {s.seq_id: BlockIds(*self.changes.pop(s.seq_id)) for s in seqs if s.seq_id in self.changes}
        finished, self.finished = frozenset(self.finished), []
        return changes, finished

    def block_table(self, seq_id: int) -> list[int]:
        self.calls.append(seq_id)
        return list(self.tables[seq_id])


def new_sequence(rng: random.Random, seq_id: int, prompt_len: int) -> Sequence:
    prompt = [rng.randrange(1, 50_000) for _ in range(prompt_len)]
    return Sequence(seq_id=seq_id, request_id=str(seq_id), prompt_token_ids=prompt, params=SamplingParams(max_tokens=64))


def schedule(rng: random.Random, kv: GrowOnlyTables, seqs: list[Sequence], extra: int = 2) -> ScheduledBatch:
    """One step for ``seqs``: a decode, the rest of the prompt or a chunk of it; tables grown to cover it."""
    items = []
    for seq in seqs:
        remaining = seq.num_tokens - seq.num_computed_tokens
        n = 1 if remaining == 1 else rng.choice((remaining, rng.randint(1, remaining)))
        kv.grow(seq.seq_id, seq.num_computed_tokens + n, extra=rng.randint(0, extra))
        items.append((seq, n))
    items.sort(key=lambda it: it[1] != 1)  # decodes first, as the scheduler orders them
    changes, finished = kv.stated(seqs)
    return ScheduledBatch([s for s, _ in items], [n for _, n in items], sum(1 for _, n in items if n == 1), [],
                          new_block_ids=changes, finished_ids=finished)


def advance(rng: random.Random, sched: ScheduledBatch) -> None:
    """What the engine does after the forward: tokens computed, a sampled token for rows that finished their prompt."""
    for seq, n in zip(sched.seqs, sched.num_new):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(rng.randrange(50_000))


def test_many_steps_of_growth_preemption_readmission_and_finishing_match_the_reference():
    """An engine's life over 120 steps: prompts chunked and decoded across block boundaries, sequences
    preempted (table freed, ``num_preemptions`` + 1) and re-admitted with a new table, as long as the old
    one or shorter, sequences finished for good, some left unscheduled for a step; every step checked."""
    rng = random.Random("engine")
    si, kv = builder(reqs=6), GrowOnlyTables(rng)
    ids, running, waiting = itertools.count(), [], []
    old_len: dict[int, int] = {}  # preempted seq_id -> length of its table before the preemption
    events: collections.Counter = collections.Counter()
    for _ in range(120):
        for seq in list(running):
            u = rng.random()
            if u < 0.15 and seq.seq_id in kv.tables:
                running.remove(seq)
                if u < 0.06:  # finished: never scheduled again
                    kv.free(seq.seq_id, finished=True)
                    events["finished"] += 1
                    continue
                old_len[seq.seq_id] = len(kv.tables[seq.seq_id])
                kv.free(seq.seq_id)
                seq.num_preemptions += 1
                seq.num_computed_tokens = 0
                waiting.append(seq)
        while len(running) < 6 and rng.random() < 0.6:
            if waiting and rng.random() < 0.7:  # back: recompute everything, or (prefix cache) all but the last token
                seq = waiting.pop(0)
                seq.num_computed_tokens = rng.choice((0, seq.num_tokens - 1))
            else:
                seq = new_sequence(rng, next(ids), rng.randint(1, 300))
            running.append(seq)
        picked = [seq for seq in running if rng.random() < 0.9]
        if not picked:
            continue
        sched = schedule(rng, kv, picked, extra=rng.choice((0, 2)))
        for seq in sched.seqs:
            if seq.seq_id in old_len:
                was, now = old_len.pop(seq.seq_id), len(kv.tables[seq.seq_id])
                events["same length" if now == was else "shorter" if now < was else "longer"] += 1
        events["wider than the first row width"] += any(len(t) > 16 for t in kv.tables.values())
        tables = {s.seq_id: list(kv.tables[s.seq_id]) for s in sched.seqs}
        check(build(si, sched, tables, kv.block_table), sched, tables)
        advance(rng, sched)
        for seq in sched.seqs:  # speculative decoding gives back blocks it took for rejected drafts
            if rng.random() < 0.1 and seq.seq_id in kv.tables:
                before = len(kv.tables[seq.seq_id])
                kv.trim(seq.seq_id, -(-seq.num_computed_tokens // BS))
                events["trimmed"] += len(kv.tables[seq.seq_id]) < before
    for what in ("finished", "same length", "shorter", "wider than the first row width", "trimmed"):
        assert events[what] >= 2, events
    assert kv.calls == [] and si.block_rows.reads == 0  # every change was stated: no table read whole


def test_without_stated_changes_only_the_tables_that_cross_into_a_new_block_are_read():
    """Batches built by hand, without changes: 48 decoding sequences, contexts spread over three blocks;
    after the first step (every table new), ``block_table`` is called once for each sequence whose new
    token is the first of a block (its row is too short), and for no other."""
    rng = random.Random("calls")
    si, kv = builder(), GrowOnlyTables(rng, states_changes=False)
    seqs = [new_sequence(rng, 7 + k, 40 + k) for k in range(48)]
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens - 1
    for step in range(2 * BS + 1):
        kv.calls.clear()
        sched = schedule(rng, kv, seqs, extra=0)
        expected = [s.seq_id for s in sched.seqs if step == 0 or s.num_computed_tokens % BS == 0]
        tables = {s.seq_id: list(kv.tables[s.seq_id]) for s in sched.seqs}
        check(build(si, sched, tables, kv.block_table), sched, tables)
        assert kv.calls == expected, step
        assert step == 0 or 0 < len(expected) < len(seqs) // 4
        advance(rng, sched)


def test_a_table_read_without_a_stated_change_is_read_whole():
    """A row too short for the step with no change stated: the whole table is read and replaces the
    row (here one whose kept entry was rewritten, outside the contract), not only the new tail."""
    rng = random.Random("rewritten")
    si, kv = builder(), GrowOnlyTables(rng, states_changes=False)
    seq = new_sequence(rng, 3, 2 * BS)
    seq.num_computed_tokens = 2 * BS - 1
    sched = schedule(rng, kv, [seq], extra=0)
    check(build(si, sched, kv.tables, kv.block_table), sched, kv.tables)
    advance(rng, sched)
    kv.tables[3][1] = rng.randrange(2**30)  # rewritten while held, just as the table grows
    sched = schedule(rng, kv, [seq], extra=0)
    assert len(kv.tables[3]) == 3
    check(build(si, sched, kv.tables, kv.block_table), sched, kv.tables)


def test_a_steady_decode_with_stated_changes_reads_no_table():
    """48 decoding sequences over three block boundaries with the changes stated: ``block_table`` is
    never called, and every row equals the manager's table."""
    rng = random.Random("stated")
    si, kv = builder(), GrowOnlyTables(rng)
    seqs = [new_sequence(rng, 7 + k, 40 + k) for k in range(48)]
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens - 1
    for step in range(2 * BS + 1):
        sched = schedule(rng, kv, seqs, extra=0)
        assert len(sched.new_block_ids) == (48 if step == 0 else sum(s.num_computed_tokens % BS == 0 for s in seqs))
        tables = {s.seq_id: list(kv.tables[s.seq_id]) for s in sched.seqs}
        check(build(si, sched, tables, kv.block_table), sched, tables)
        assert all(si.block_rows.blocks(sid) == t for sid, t in tables.items())
        advance(rng, sched)
    assert kv.calls == [] and si.block_rows.reads == 0


@pytest.mark.parametrize("num_seqs", [1, 8, 48])
def test_steady_steps_without_poison_rewrite_what_changed(num_seqs):
    """Decodes of the same sequences step after step, the staging buffer not poisoned: a step of the
    same layout keeps what the previous one wrote where nothing changed (the query starts, the block
    tables of the same rows); every step, across block boundaries (rows appended to, the layout wider)
    and a preemption that rewrites one table at the same length, equals the reference."""
    rng = random.Random(f"steady-{num_seqs}")
    si, kv = builder(), GrowOnlyTables(rng)
    seqs = [new_sequence(rng, 7 + k, 40 + 5 * k) for k in range(num_seqs)]
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens - 1
    unchanged = 0
    for step in range(3 * BS):
        if step == 2 * BS:  # seqs[0] preempted and back with a new table of the same length, its prefix cached
            kv.free(seqs[0].seq_id)
            seqs[0].num_preemptions += 1
        sched = schedule(rng, kv, seqs, extra=0)
        unchanged += not sched.new_block_ids
        tables = {s.seq_id: list(kv.tables[s.seq_id]) for s in sched.seqs}
        check(si.build(sched, kv.block_table), sched, tables)
        advance(rng, sched)
    assert kv.calls == [] and (num_seqs == 48 or unchanged >= BS)


def test_host_copies_are_reused_only_when_nothing_holds_them():
    """On CPU a step's tensors are a copy of the staging buffer; a later step of the same layout reuses
    that copy only once nothing holds any of its tensors: a view of one field alone keeps it."""
    rng = random.Random("copies")
    si, kv = builder(), GrowOnlyTables(rng)
    seqs = [new_sequence(rng, 7 + k, 3 + k) for k in range(3)]  # contexts 2-4: four steps in one block
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens - 1

    def step() -> tuple[Any, dict[str, Any]]:
        sched = schedule(rng, kv, seqs, extra=0)
        tables = {s.seq_id: list(kv.tables[s.seq_id]) for s in sched.seqs}
        out = si.build(sched, kv.block_table)
        snap = check(out, sched, tables)
        advance(rng, sched)
        return out, snap

    out, _ = step()
    ptr = out[0].input_ids.data_ptr()
    del out
    out, snap = step()
    assert out[0].input_ids.data_ptr() == ptr  # nothing held the first step's tensors: its copy was reused
    view, held = out[0].batch.slot_mapping[1:], snap["slot_mapping"][2][1:]
    del out
    out, _ = step()
    assert out[0].input_ids.data_ptr() != ptr and view.tolist() == held  # the view kept the copy from reuse
    del view, out
    out, _ = step()
    assert out[0].input_ids.data_ptr() == ptr  # the view gone, the first copy is free again


def test_block_rows_say_which_slots_were_written_since_a_version(monkeypatch):
    """``written_since`` lists the slot of every write after a version, and ``None`` once that is not
    known any more: after the table is widened, or more writes than the log keeps."""
    monkeypatch.setattr(step_inputs, "_WRITE_LOG", 4)
    br = BlockRows(BS, slots=4, width=2)
    br.apply((), {1: BlockIds(0, [5]), 2: BlockIds(0, [6])})
    s1, s2 = br._rows[1].slot, br._rows[2].slot
    v = br.version
    assert br.written_since(v) == [] and br.written_since(v - 1) == [s2]
    br.apply((), {2: BlockIds(1, [7]), 1: BlockIds(1, [8])})
    assert br.written_since(v) == [s2, s1]
    br.apply((), {1: BlockIds(2, [9])})  # wider than the table: every row moves
    assert br.written_since(v) is None and br.written_since(br.version) == []
    v = br.version
    br.apply((), {2: BlockIds(0, [3]), 1: BlockIds(3, [2])})
    assert br.written_since(v) == [s2, s1]
    for k in range(3):
        br.apply((), {1: BlockIds(1, [10 + k])})
    assert br.written_since(v) is None and br.written_since(br.version - 2) == [s1, s1]


def test_a_long_run_of_short_lived_sequences_keeps_the_rows_bounded():
    """800 steps, a new sequence every step or so, each living a few steps, every 50th step a burst of
    40 more, beside one sequence decoding throughout (its row, in use, must survive the evictions a
    burst causes): the rows stay at max(2 x max_num_reqs, 64); then one step of more sequences than
    that makes room for all of them."""
    rng = random.Random("bounded")
    si, kv = builder(reqs=4), GrowOnlyTables(rng)
    rows = si.block_rows
    assert rows.table.shape == (64, 16)
    ids, live = itertools.count(), []
    elder = new_sequence(rng, next(ids), 10)
    for step in range(800):
        while len(live) < 4 and rng.random() < 0.5:
            live.append([new_sequence(rng, next(ids), rng.randint(1, 100)), rng.randint(1, 6)])
        burst = [new_sequence(rng, next(ids), rng.randint(1, 30)) for _ in range(40 if step % 50 == 49 else 0)]
        sched = schedule(rng, kv, [elder] + [seq for seq, _ in live if rng.random() < 0.8] + burst)
        check(build(si, sched, kv.tables, kv.block_table), sched, kv.tables)
        advance(rng, sched)
        for entry in list(live):
            entry[1] -= 1
            if entry[1] == 0:
                live.remove(entry)
                kv.tables.pop(entry[0].seq_id, None)  # freed (if it was ever scheduled)
        assert len(rows) <= 64 and rows.table.shape[0] == 64, (len(rows), rows.table.shape)
    assert next(ids) > 16 * 64  # rows were reused many times over
    assert elder.num_tokens > 800 and rows.table.shape[1] == 64  # 16, doubled twice for the elder's 51 blocks
    many = [new_sequence(rng, next(ids), rng.randint(1, 40)) for _ in range(70)]
    sched = schedule(rng, kv, many)
    check(build(si, sched, kv.tables, kv.block_table), sched, kv.tables)
    assert len(rows) >= 70 and rows.table.shape[0] == 128

# ----------------------------------------------------------------------------- through the runner
def test_prepare_inputs_of_a_real_run_matches_the_reference(tmp_path):
    """Every step of a generation (chunked prompts beside decodes, a shared cached prefix) through ModelRunner."""
    from corerun import LLM

    from tests.helpers.tiny_models import make_tiny_model

    llm = LLM(model=make_tiny_model(tmp_path, "llama"), device="cpu", dtype="float32", attention="torch",
              kv_cache={"block_size": 4, "num_blocks": 96}, scheduler={"max_num_batched_tokens": 20, "max_model_len": 96})
    runner = llm.engine.runner
    prepare, kept = runner.prepare_inputs, []

    def checked(sched: ScheduledBatch) -> Any:
        tables = {s.seq_id: runner.kv_manager.block_table(s.seq_id) for s in sched.seqs}
        out = prepare(sched)
        kept.append((out, check(out, sched, tables, bs=4)))
        return out

    runner.prepare_inputs = checked
    rng = random.Random(8)
    shared = [rng.randrange(3, 200) for _ in range(9)]
    prompts = [shared + [rng.randrange(3, 200) for _ in range(n)] for n in (2, 30, 5, 17, 1)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [6] * 5
    kinds = {(b.is_pure_decode, b.num_decodes > 0) for b in (o[0].batch for o, _ in kept)}
    assert {(True, True), (False, True), (False, False)} <= kinds  # decode-only, mixed and prefill-only steps
    assert all(snapshot(out) == snap for out, snap in kept)


def test_prepare_inputs_of_a_run_with_preemptions_matches_the_reference(tmp_path):
    """A KV cache too small for every request at once: sequences are preempted, freed and recomputed
    into new tables under the same seq_id; every step's inputs still match the manager's tables."""
    from corerun import LLM

    from tests.helpers.tiny_models import make_tiny_model

    llm = LLM(model=make_tiny_model(tmp_path, "llama"), device="cpu", dtype="float32", attention="torch",
              kv_cache={"block_size": 4, "num_blocks": 40}, scheduler={"max_num_batched_tokens": 64, "max_model_len": 96})
    runner, steps = llm.engine.runner, []

    def checked(sched: ScheduledBatch, prepare=runner.prepare_inputs) -> Any:
        tables = {s.seq_id: runner.kv_manager.block_table(s.seq_id) for s in sched.seqs}
        out = prepare(sched)
        check(out, sched, tables, bs=4)
        steps.append({s.seq_id: s.num_preemptions for s in sched.seqs})
        return out

    runner.prepare_inputs = checked
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(20, 40))] for _ in range(6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [24] * 6
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(n > 0 for step in steps for n in step.values())  # preempted sequences ran again


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_a_block_table_too_short_for_the_step_is_refused_by_name(kind):
    """A KV-cache manager that did not grow a table: an error naming the sequence, never slots in another's blocks."""
    rng = random.Random(f"short-{kind}")
    si = builder()
    sched, tables = random_step(rng, kind, 5, max_extra_blocks=0)
    victim = sched.seqs[3]
    tables[victim.seq_id] = tables[victim.seq_id][:-1]
    need = -(-(victim.num_computed_tokens + sched.num_new[3]) // BS)
    with pytest.raises(ValueError, match=rf"sequence {victim.seq_id}'s block table has {need - 1} blocks.*need {need} blocks"):
        build(si, sched, tables)


def test_a_sequence_scheduled_no_token_is_refused_by_name():
    rng = random.Random("zero")
    sched, tables = random_step(rng, "prefill", 3)
    sched.num_new[1] = 0
    with pytest.raises(ValueError, match=rf"sequence {sched.seqs[1].seq_id} is scheduled 0 tokens"):
        build(builder(), sched, tables)


def test_sampled_hidden_rows_gather_only_when_some_rows_are_not_sampled(tmp_path):
    """All rows sampled (a decode step): the hidden states as they are, no index copy; else exactly the rows asked."""
    from corerun.config import Config
    from corerun.runner.model_runner import ModelRunner
    from tests.helpers.tiny_models import make_tiny_model

    runner = ModelRunner(Config(model=str(make_tiny_model(tmp_path)), device="cpu", dtype="float32", attention="torch",
                                kv_cache={"num_blocks": 4}, scheduler={"max_model_len": 64}))
    hidden = torch.randn(6, 64)
    # one decode, then two prefills of 2 and 3 tokens: rows 0 | 1 2 | 3 4 5
    qsl = torch.tensor([0, 1, 3, 6], dtype=torch.int32)
    batch = SimpleNamespace(num_reqs=3, query_start_loc=qsl)
    decodes = SimpleNamespace(num_reqs=6, query_start_loc=torch.arange(7, dtype=torch.int32))
    assert runner._sampled_hidden(hidden, decodes, np.arange(6, dtype=np.int64)) is hidden
    every_request = runner._sampled_hidden(hidden, batch, np.array([0, 2, 5], dtype=np.int64))
    assert torch.equal(every_request, hidden[[0, 2, 5]])  # each request's last token, from query_start_loc
    some = runner._sampled_hidden(hidden, batch, np.array([0, 5], dtype=np.int64))  # request 1 is a mid-prompt chunk
    assert torch.equal(some, hidden[[0, 5]])
