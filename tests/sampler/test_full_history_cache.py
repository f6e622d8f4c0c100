"""Penalties from the per-request history cache (``SamplingMetadata.seq_ids``) over many steps.

Requests join, leave, come back, and grow by one or several tokens a step, with penalties mixed per
row.  Every step is compared with a float64 statement of vLLM's penalty rules written here, and with
the stateless path (``seq_ids=None``), which must give the same logits bit for bit.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

import pytest
import torch

from corerun.protocols import SamplingMetadata
from corerun.sampling_params import SamplingParams as SP
from corerun.sampler import history_cache
from corerun.sampler.history_cache import HistoryCache
from corerun.sampler.penalties import apply_penalties
from corerun.sampler.full import FullSampler

# (repetition, frequency, presence) per kind of request; (1, 0, 0) uses no penalty, so gets no entry
KINDS = [(1.0, 0.0, 0.0), (1.7, 0.0, 0.0), (0.6, 0.0, 0.0), (1.0, 0.8, 0.0), (1.0, 0.0, -1.3),
         (1.3, -0.7, 0.5), (1.0, 1.9, 0.9), (0.8, 0.3, -0.2)]


def reference(logits: torch.Tensor, prompts, outputs, rep, freq, pres) -> torch.Tensor:
    """float64 ``[B, V]``: the penalty rules token by token (prompt or output: repetition; output counts: the rest)."""
    want = logits.to(torch.float64).clone()
    for i in range(want.shape[0]):
        seen = set(prompts[i]) | set(outputs[i])
        counts = Counter(outputs[i])
        for t in range(want.shape[1]):
            if t in seen:
                want[i, t] = want[i, t] / rep[i] if want[i, t] > 0 else want[i, t] * rep[i]
            want[i, t] -= freq[i] * counts[t] + pres[i] * (counts[t] > 0)
    return want


@dataclass
class Request:
    seq_id: int
    kind: tuple[float, float, float]
    prompt: list[int]
    output: list[int] = field(default_factory=list)


@dataclass
class Step:
    seq_ids: list[int]
    prompts: list[list[int]]
    outputs: list[list[int]]
    rep: list[float]
    freq: list[float]
    pres: list[float]


def scenario(vocab: int, steps: int, seed: int) -> tuple[list[Step], Counter]:
    """Steps of a changing batch, and a tally of what happened (joins, leaves, returns, multi-token growth)."""
    rng = random.Random(seed)
    pool = [
        Request(1000 + 17 * j, KINDS[j % len(KINDS)], [rng.randrange(vocab) for _ in range(rng.randrange(0, 30))])
        for j in range(14)
    ]
    present: set[int] = set()
    seen: set[int] = set()
    events: Counter = Counter()
    out: list[Step] = []
    for k in range(steps):
        for r in pool:
            if r.seq_id not in present and rng.random() < (0.5 if k < 2 else 0.3):
                events["returns" if r.seq_id in seen else "joins"] += 1
                present.add(r.seq_id)
                seen.add(r.seq_id)
            elif r.seq_id in present and rng.random() < 0.15:
                events["leaves"] += 1
                present.discard(r.seq_id)
        for r in pool:
            grow = 0
            if r.seq_id in present and (k or r.output or rng.random() < 0.5):
                grow = 1 if rng.random() < 0.7 else rng.randrange(2, 9)
            elif r.seq_id in seen and rng.random() < 0.3:
                grow = rng.randrange(1, 5)  # grows while away
            events["multi"] += grow > 1 and r.seq_id in present
            # tokens from a narrow range, so outputs repeat tokens and overlap the prompt
            r.output += [rng.randrange(vocab // 3) for _ in range(grow)]
        rows = [r for r in pool if r.seq_id in present]
        rng.shuffle(rows)
        out.append(
            Step(
                [r.seq_id for r in rows], [list(r.prompt) for r in rows], [list(r.output) for r in rows],
                [r.kind[0] for r in rows], [r.kind[1] for r in rows], [r.kind[2] for r in rows],
            )
        )
    return out, events


POISON = 1 << 40  # far outside any vocabulary: a position read before it is written breaks the step


class _PoisonedTorch:
    """``torch``, except that ``empty`` returns tensors filled with ``POISON`` (the arena starts poisoned)."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def empty(*size, **kwargs) -> torch.Tensor:
        return torch.full(size, POISON, **kwargs)


@pytest.fixture(autouse=True)
def _poisoned_arena(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history_cache, "torch", _PoisonedTorch())


def _penalties(s: Step, j: int) -> dict[str, float]:
    return {"repetition_penalty": s.rep[j], "frequency_penalty": s.freq[j], "presence_penalty": s.pres[j]}


@pytest.fixture
def tiny_arena(monkeypatch: pytest.MonkeyPatch) -> None:
    """An arena of 8 positions and no spare room per entry: every few appends move an entry or compact."""
    monkeypatch.setattr(history_cache, "MIN_ARENA", 8)
    monkeypatch.setattr(history_cache, "MIN_ROOM", 1)


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    calls = [0]
    original = getattr(HistoryCache, name)

    def wrapped(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(HistoryCache, name, wrapped)
    return calls


@pytest.mark.parametrize("arena", ["default", "tiny"])
def test_steps_match_the_reference_and_the_stateless_path(request, monkeypatch: pytest.MonkeyPatch, arena: str) -> None:
    if arena == "tiny":
        request.getfixturevalue("tiny_arena")
    compactions = _counting(monkeypatch, "_compact")
    vocab = 97
    steps, events = scenario(vocab, steps=24, seed=5)
    assert min(events["joins"], events["leaves"], events["returns"], events["multi"]) >= 3, events
    cache = HistoryCache()
    gen = torch.Generator().manual_seed(11)
    held: set[int] = set()  # requests that used a penalty in some step: absent ones keep their entry
    for k, s in enumerate(steps):
        logits = (torch.randn(len(s.seq_ids), vocab, generator=gen, dtype=torch.float64) * 3).float()
        cached, stateless = logits.clone(), logits.clone()
        apply_penalties(cached, s.prompts, s.outputs, s.rep, s.freq, s.pres, cache, s.seq_ids)
        apply_penalties(stateless, s.prompts, s.outputs, s.rep, s.freq, s.pres)
        assert torch.equal(cached, stateless), f"step {k}: cached and stateless logits differ"
        want = reference(logits, s.prompts, s.outputs, s.rep, s.freq, s.pres)
        torch.testing.assert_close(cached.double(), want, rtol=1e-6, atol=1e-5, msg=lambda m: f"step {k}: {m}")
        # every request that used a penalty so far holds an entry (none finished here), no other
        held |= {sid for sid, r, f, a in zip(s.seq_ids, s.rep, s.freq, s.pres) if (r, f, a) != (1.0, 0.0, 0.0)}
        assert {sid for sid in range(1000, 1300) if sid in cache} == held
    assert compactions[0] >= (5 if arena == "tiny" else 1)


def test_sampler_with_and_without_seq_ids_give_the_same_distribution(ref) -> None:
    """Processed logprobs of the whole (20-token) vocabulary, greedy and random rows, with and without seq_ids."""
    vocab = 20
    steps, _ = scenario(vocab, steps=12, seed=3)
    cached, stateless = FullSampler(vocab, "cpu", logprobs_mode="processed"), FullSampler(vocab, "cpu", logprobs_mode="processed")
    gen = torch.Generator().manual_seed(2)
    for k, s in enumerate(steps):
        params = [
            SP(temperature=0.0 if j % 2 else 0.9, logprobs=vocab, seed=j, **_penalties(s, j)) for j in range(len(s.seq_ids))
        ]
        logits = torch.randn(len(params), vocab, generator=gen) * 2
        with_ids = SamplingMetadata(params, s.prompts, s.outputs, seq_ids=s.seq_ids)
        a = cached.sample(logits, with_ids)
        b = stateless.sample(logits, SamplingMetadata(params, s.prompts, s.outputs))
        assert torch.equal(a.sampled_token_ids, b.sampled_token_ids), f"step {k}"
        assert torch.equal(a.logprobs.logprobs, b.logprobs.logprobs) and torch.equal(a.logprobs.token_ids, b.logprobs.token_ids)
        got = torch.full((len(params), vocab), math.nan, dtype=torch.float64)  # poison: every token must be written
        got.scatter_(1, a.logprobs.token_ids[:, 1:], a.logprobs.logprobs[:, 1:].double())
        assert not got.isnan().any()
        for i, p in enumerate(params):
            if p.greedy:
                want = torch.log_softmax(ref.processed_row(logits[i], p, s.prompts[i], s.outputs[i], ()), dim=0)
                torch.testing.assert_close(got[i], want, rtol=0, atol=2e-5)
                assert a.sampled_token_ids[i].item() == int(want.argmax())


def _penalize(cache: HistoryCache, logits, seq_ids, prompts, outputs, rep, freq, pres) -> torch.Tensor:
    x = logits.clone()
    apply_penalties(x, prompts, outputs, rep, freq, pres, cache, seq_ids)
    torch.testing.assert_close(x.double(), reference(logits, prompts, outputs, rep, freq, pres), rtol=1e-6, atol=1e-5)
    return x


def test_guard_rebuilds_an_entry_the_lists_disagree_with() -> None:
    """The same seq_id with another prompt length, a shorter output, another last token, or a prompt now needed."""
    vocab = 40
    cache = HistoryCache()
    logits = torch.randn(1, vocab) * 3
    sid, prompt, output = [7], [[3, 4, 5, 5]], [[9, 9, 10, 11]]
    _penalize(cache, logits, sid, prompt, output, [1.0], [0.7], [0.3])  # frequency only: no prompt kept
    first = cache._entries[7]
    assert not first.has_prompt and first.out_len == 4
    _penalize(cache, logits, sid, prompt, [[9, 9, 10, 11, 12]], [1.0], [0.7], [0.3])
    assert cache._entries[7] is first and first.out_len == 5  # appended, not rebuilt
    cases = [
        ("prompt needed", prompt, [[9, 9, 10, 11, 12]], [1.4]),
        ("prompt length", [[3, 4, 5]], [[9, 9, 10, 11, 12]], [1.4]),
        ("output shorter", [[3, 4, 5]], [[9, 9, 10]], [1.4]),
        ("last token", [[3, 4, 5]], [[9, 9, 13, 14]], [1.4]),  # 9, 9, 10 then 14: position 2 changed
    ]
    for what, p, o, rep in cases:
        before = cache._entries[7]
        _penalize(cache, logits, sid, p, o, rep, [0.7], [0.3])
        assert cache._entries[7] is not before, what
        assert cache._entries[7].out_len == len(o[0]) and cache._entries[7].prompt_len == len(p[0]), what


def test_absent_requests_keep_their_entry_and_finished_ones_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Protocol version 2: an entry lives until its request finishes (``forget``), not until it misses a step."""
    builds = _counting(monkeypatch, "_build")
    vocab, cache = 30, HistoryCache()
    logits = torch.randn(3, vocab) * 2
    prompts, outputs = [[1, 2], [3], [4, 4]], [[5], [6, 6], [7]]
    _penalize(cache, logits, [1, 2, 3], prompts, outputs, [1.2, 1.0, 1.5], [0.0, 0.0, 0.4], [0.0, 0.0, 0.0])
    assert 1 in cache and 2 not in cache and 3 in cache and builds[0] == 2  # request 2 uses no penalty
    _penalize(cache, logits[:1], [3], prompts[2:], [[7, 8, 8]], [1.5], [0.4], [0.0])  # request 1 skipped
    assert len(cache) == 2 and 1 in cache and builds[0] == 2
    _penalize(cache, logits[:2], [1, 3], [prompts[0], prompts[2]], [[5, 9, 9], [7, 8, 8, 1]], [1.2, 1.5], [0.0, 0.4], [0.0, 0.0])
    assert builds[0] == 2  # request 1 came back: its entry took in the two tokens it gained; request 3 appended
    cache.forget([1, 99])  # finished (99: never held an entry)
    assert 1 not in cache and 3 in cache
    _penalize(cache, logits[:1], [5], [[1]], [[2]], [1.0], [0.0], [0.0])  # no penalty in the step: nothing new kept
    assert len(cache) == 1
    cache.forget([3])
    assert len(cache) == 0


def test_an_entry_nobody_reports_finished_goes_after_idle_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history_cache, "IDLE_SYNCS", 4)
    vocab, cache = 30, HistoryCache()
    logits = torch.randn(1, vocab) * 2
    _penalize(cache, logits, [1], [[1, 2]], [[5]], [1.2], [0.0], [0.0])
    for sync in range(2, 9):  # request 1 absent: the sweep at sync 4 keeps it (unused for 3), the one at 8 drops it
        _penalize(cache, logits, [2], [[3]], [[4]], [1.3], [0.0], [0.0])
        assert (1 in cache) == (sync < 8), sync
    assert 2 in cache


def test_stateless_calls_and_repeated_ids_leave_the_cache_alone() -> None:
    vocab, cache = 30, HistoryCache()
    logits = torch.randn(2, vocab) * 2
    _penalize(cache, logits, [4, 8], [[1], [2]], [[3], [4]], [1.3, 1.3], [0.2, 0.2], [0.0, 0.0])
    entries = dict(cache._entries)
    _penalize(cache, logits, None, [[1], [2]], [[3, 3], [4, 4]], [1.3, 1.3], [0.2, 0.2], [0.0, 0.0])
    _penalize(cache, logits, [4, 4], [[1], [1]], [[3, 5], [3, 6]], [1.3, 1.3], [0.2, 0.2], [0.0, 0.0])
    assert cache._entries == entries and all(cache._entries[k] is entries[k] for k in entries)
    assert entries[4].out_len == 1 and entries[8].out_len == 1


class CountingTokens(SequenceABC):
    """A token list that counts element reads (``__iter__`` counts every element it yields)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.reads = tokens, 0

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):  # type: ignore[override]
        item = self.tokens[i]
        self.reads += len(item) if isinstance(i, slice) else 1
        return item

    def __iter__(self):
        for t in self.tokens:
            self.reads += 1
            yield t


def test_host_reads_follow_the_new_tokens_not_the_history() -> None:
    """Once warm, a step reads each output's new tokens and one guard token, and no prompt token."""
    batch, vocab, prompt_len = 16, 500, 400
    gen = torch.Generator().manual_seed(3)
    prompts = [CountingTokens(torch.randint(vocab, (prompt_len,), generator=gen).tolist()) for _ in range(batch)]
    outputs = [CountingTokens(torch.randint(vocab, (50,), generator=gen).tolist()) for _ in range(batch)]
    sampler = FullSampler(vocab, "cpu")
    params = [SP(temperature=0, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3)] * batch
    seq_ids = list(range(batch))
    for step in range(6):
        for o in prompts + outputs:
            o.reads = 0
        new = 1 if step % 2 else 3
        for o in outputs:
            o.tokens += torch.randint(vocab, (new,), generator=gen).tolist()
        logits = torch.randn(batch, vocab, generator=gen)
        got = sampler.sample(logits, SamplingMetadata(params, prompts, outputs, seq_ids=seq_ids)).sampled_token_ids
        want = reference(logits, [p.tokens for p in prompts], [o.tokens for o in outputs], [1.2] * batch, [0.5] * batch, [0.3] * batch)
        assert got.tolist() == want.argmax(dim=1).tolist()
        if step:
            assert all(p.reads == 0 for p in prompts)
            assert all(o.reads == new + 1 for o in outputs), [o.reads for o in outputs]


def test_cached_steps_read_no_tensor_value_on_the_host(tiny_arena, monkeypatch: pytest.MonkeyPatch, forbid_host_sync) -> None:
    """Builds, appends, moves and compactions of the cache under the CPU stand-in for CUDA's sync check."""
    steps, _ = scenario(50, steps=10, seed=8)
    sampler = FullSampler(50, "cpu")
    inputs = []
    for s in steps:
        params = [SP(temperature=0.7, **_penalties(s, j)) for j in range(len(s.seq_ids))]
        inputs.append((torch.randn(len(params), 50), SamplingMetadata(params, s.prompts, s.outputs, seq_ids=s.seq_ids)))
    forbid_host_sync()
    shapes = [tuple(sampler.sample(logits, md).sampled_token_ids.shape) for logits, md in inputs]
    monkeypatch.undo()
    assert shapes == [(len(s.seq_ids),) for s in steps]


def test_a_new_device_starts_a_new_arena() -> None:
    """An arena lives on one device; a step on another drops it (the arena moved to ``meta`` stands for another device)."""
    cache = HistoryCache()
    logits = torch.randn(1, 10)
    _penalize(cache, logits, [1], [[1]], [[2]], [1.5], [0.0], [0.0])
    cache._data = cache._data.to("meta")  # as if it had been built on another device
    _penalize(cache, logits, [1], [[1]], [[2, 3]], [1.5], [0.0], [0.0])
    assert cache._data.device.type == "cpu" and cache._entries[1].out_len == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_cached_steps_do_not_synchronize() -> None:
    steps, _ = scenario(64, steps=8, seed=4)
    cuda, cpu = FullSampler(64, "cuda"), FullSampler(64, "cpu")
    for k, s in enumerate(steps):
        params = [SP(temperature=0, **_penalties(s, j)) for j in range(len(s.seq_ids))]
        md = SamplingMetadata(params, s.prompts, s.outputs, seq_ids=s.seq_ids)
        logits = torch.randn(len(params), 64)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = cuda.sample(logits.cuda(), md).sampled_token_ids
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert out.cpu().tolist() == cpu.sample(logits, md).sampled_token_ids.tolist(), f"step {k}"
