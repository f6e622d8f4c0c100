"""Protocol version 3 through the engine: the scheduler sends each step as a message of plain values,
and the runner's persistent batch, changed only by applying them, follows the requests.

- After each step's message is applied, the runner holds, for every scheduled request, the KV-cache
  manager's ``block_table`` and the request's tokens (those of the step in flight included), over
  runs with preemption (recompute), resumption, prefix hits and speculative decoding's trims, and
  greedy outputs stay equal to transformers'.
- A penalised request skipped by the scheduler (preempted, waiting) samples from its whole history
  when it comes back: the tokens equal an independent computation, transformers' logits with vLLM's
  penalty rules applied in float64.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from corerun import LLM, SamplingParams
from corerun.core.scheduler import ScheduledBatch
from corerun.testing import hf_greedy
from tests.helpers.tiny_models import make_tiny_model

BS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("v2"), arch="llama")


def _watch_block_rows(llm: LLM) -> tuple[Counter, list[str]]:
    """After each step's message is applied: every scheduled request's row holds the manager's table and
    the request's tokens."""
    runner, kv, scheduler = llm.engine.runner, llm.engine.kv, llm.engine.scheduler
    events, problems = Counter(), []
    prepare = runner.prepare_inputs

    def checked(sched: ScheduledBatch):
        seqs = scheduler.seqs_of(sched)
        out = prepare(sched)
        rows = runner.input_batch
        for seq in seqs:
            if rows.blocks(seq.seq_id) != kv.block_table(seq.seq_id):
                problems.append(f"step {events['steps']}: seq {seq.seq_id}: row {rows.blocks(seq.seq_id)}, "
                                f"manager {kv.block_table(seq.seq_id)}")
            if rows.tokens(seq.seq_id) != seq.token_ids:
                problems.append(f"step {events['steps']}: seq {seq.seq_id}: row tokens {rows.tokens(seq.seq_id)}, "
                                f"sequence {seq.token_ids}")
        events["steps"] += 1
        events["resumed"] += len(sched.resumed_ids)
        events["finished"] += len(sched.finished_ids)
        events["appended"] += sum(1 for c in sched.new_block_ids.values() if c.start > 0 and c.ids)
        return out

    trim = scheduler.trim

    def counted_trim(seq, num_tokens):
        before = len(kv.block_table(seq.seq_id))
        trim(seq, num_tokens)
        events["trimmed"] += len(kv.block_table(seq.seq_id)) < before

    runner.prepare_inputs = checked
    scheduler.trim = counted_trim
    return events, problems


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_block_rows_follow_the_stated_changes_through_preemption_prefix_hits_and_trims(model_dir: Path, spec: bool) -> None:
    g = torch.Generator().manual_seed(5)
    rnd = lambda n: torch.randint(3, 256, (n,), generator=g).tolist()  # noqa: E731
    base = rnd(7)
    prompts = [base * 3, base * 2 + rnd(3), rnd(9), base * 3 + rnd(1), rnd(2 * BS + 1) * 2, base * 2]
    extra = {"speculative": {"method": "ngram", "num_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}} if spec else {}
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", attention="torch",
              kv_cache={"block_size": BS, "num_blocks": 24},
              scheduler={"max_model_len": 96, "max_num_batched_tokens": 9, "max_num_seqs": 4}, **extra)
    events, problems = _watch_block_rows(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model_dir, prompts, 20)
    assert not problems, problems[:5]
    assert llm.engine.scheduler.num_preemptions > 0 and events["resumed"] > 0, events
    assert events["appended"] > 0 and events["finished"] > 0, events
    assert llm.engine.kv.stats().prefix_hits > 0
    if spec:
        assert events["trimmed"] > 0, events
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks


PENALTIES = dict(repetition_penalty=1.8, frequency_penalty=0.9, presence_penalty=0.6)


def _reference(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy with the penalties: transformers' float32 logits, vLLM's rules applied in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            x = model(torch.tensor([prompt + out])).logits[0, -1].to(torch.float64)
            for t in set(prompt) | set(out):
                x[t] = x[t] / PENALTIES["repetition_penalty"] if x[t] > 0 else x[t] * PENALTIES["repetition_penalty"]
            for t, c in Counter(out).items():
                x[t] -= PENALTIES["frequency_penalty"] * c + PENALTIES["presence_penalty"]
            out.append(int(x.argmax()))
    return out


def test_a_skipped_request_samples_from_its_whole_penalty_history(model_dir: Path, caplog) -> None:
    # a KV cache too small for the five requests at once: the youngest are preempted, wait, and are
    # recomputed, missing sampling steps while they hold outputs (and a penalty history)
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", attention="torch",
              kv_cache={"block_size": BS, "num_blocks": 11}, scheduler={"max_model_len": 96, "max_num_seqs": 5})
    skipped: Counter = Counter()
    prepare, sc = llm.engine.runner.prepare_inputs, llm.engine.scheduler

    def watch(sched: ScheduledBatch):
        present = {s.seq_id for s, n in zip(sc.seqs_of(sched), sched.num_scheduled) if s.num_computed_tokens + n == s.num_tokens}
        for seq in [*sc.running, *sc.waiting]:
            if seq.num_output_tokens and seq.seq_id not in present:
                skipped[seq.seq_id] += 1  # has a history, not sampled this step
        return prepare(sched)

    llm.engine.runner.prepare_inputs = watch
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 40, (n,), generator=g).tolist() for n in (5, 3, 6, 2, 4)]  # small range: repeats
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, **PENALTIES)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [_reference(model_dir, p, 10) for p in prompts]
    assert sc.num_preemptions > 0 and sum(skipped.values()) >= 5, (sc.num_preemptions, skipped)
    # the first preemption says so, naming the cache and the settings that give it room
    warned = [r.getMessage() for r in caplog.records if r.name == "corerun.engine" and "preempted" in r.getMessage()]
    assert warned and "KV cache full" in warned[0] and "11 blocks of" in warned[0] and "kv_cache.cpu_memory_gb" in warned[0]
    assert len(warned) == sum(n in (1, 10, 100) for n in range(1, sc.num_preemptions + 1)), (warned, sc.num_preemptions)
