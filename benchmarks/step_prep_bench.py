"""Host-side cost of one step: scheduling + input preparation, corerun vs a per-token Python baseline.

The measured code is corerun's own: an ``LLMEngine`` is built on a tiny random Llama (the model is
never run, only its runner's ``prepare_inputs``), so the ``Scheduler``, the ``paged`` KV-cache
manager and ``ModelRunner.prepare_inputs`` are the production objects with the production config.
A step is the scheduler's ``ScheduledBatch`` (a frozen message: new requests in full, the others as
changes) applied to the runner's persistent ``InputBatch``, whose arrays the step's tensors are
filled from; both are timed, as the engine runs them.  Between steps the benchmark does what the
engine does after a forward pass, untimed: the runner records a sampled token per sampled row and
the scheduler applies the step's result (``Scheduler.update_from_output``: computed tokens, full
blocks registered for prefix caching, the token appended).

Scenarios:

- ``decode``: ``N`` running sequences (1, 8, 64, 256 by default), each with up to ``--context-len``
  tokens already in the KV cache (512 by default), each step decoding one token per sequence;
  contexts are staggered over one block (sequence ``i`` holds ``context_len - i % block_size``
  tokens), so that on every step about one sequence in ``block_size`` crosses into a new block, as
  in serving, rather than all of them on the same step;
- ``long decode``: the same with long contexts, ``--long`` (``SEQSxCONTEXT`` pairs; 256 sequences
  at 16k tokens and 32 at 128k by default): the block tables are 1024 and 8192 blocks wide;
- ``prefill``: ``N`` fresh prompts of ``--context-len`` tokens scheduled in one step (``--prefill-seqs``).

Every step, both input builders run on the same ``ScheduledBatch``, in alternating order: corerun's
``prepare_inputs`` (the message applied to ``corerun.runner.input_batch.InputBatch``, then
``corerun.runner.step_inputs``: a staging buffer filled from the persistent batch's arrays, from
Python lists and row slices for up to ``StepInputs.small_batch`` requests and by vectorised numpy
for more, the buffers taken in turn and their own views handed out on CPU) and
:func:`baseline_prepare`, written here the straightforward way (reading the scheduler's live ``Sequence`` objects and the KV-cache manager's block tables, Python
lists filled token by token, as nano-vllm's ``prepare_decode`` / ``prepare_prefill``, then
``torch.tensor``).  Their outputs are compared for equality at every step, untimed (the persistent
batch is only ever changed by the messages, so a drift would show on a later step).  The table gives
medians over ``--steps`` steps, and the ratio baseline / corerun; the JSON adds the means (a step
where sequences cross into a new block costs more than one where none does).

    python benchmarks/step_prep_bench.py                       # decode 1, 8, 64, 256 at context 512; long; prefill 1, 16
    python benchmarks/step_prep_bench.py --long 256x16384 --seqs '' --prefill-seqs ''
    python benchmarks/step_prep_bench.py --seqs 1,64,256 --context-len 512 --steps 100 --json
    python benchmarks/step_prep_bench.py --clock cpu --json   # on a shared machine: CPU time, not time waiting for a core
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import corerun  # noqa: F401  (before torch: its OpenMP settings, corerun.platform.host)
import torch  # noqa: E402

from corerun.config import load_config  # noqa: E402
from corerun.engine.llm_engine import LLMEngine  # noqa: E402
from corerun.core.batch import ScheduledBatch, StepResult  # noqa: E402
from corerun.core.sequence import Sequence  # noqa: E402
from corerun.sampling_params import SamplingParams  # noqa: E402


CLOCK = time.perf_counter  # what the steps are timed with (--clock)


# ----------------------------------------------------------------------------- the baseline
def baseline_prepare(sched: ScheduledBatch, seqs: list[Sequence], kv: Any, block_size: int, device: torch.device) -> dict[str, Any]:
    """The same inputs as ``ModelRunner.prepare_inputs``, built token by token in Python lists from the
    live ``seqs`` (row ``i`` of ``sched``, as the scheduler holds them before the step runs) and the
    KV-cache manager's block tables.

    Returns int64 ``input_ids`` / ``positions`` / ``slot_mapping`` ``[num_tokens]``, int32
    ``query_start_loc`` ``[R + 1]``, ``seq_lens`` / ``context_lens`` ``[R]``, ``block_tables``
    ``[R, max blocks]`` (zero-padded), and the sampled rows with their logits indices (lists).
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    context_lens: list[int] = []
    tables: list[list[int]] = []
    sampled_rows: list[int] = []
    logits_indices: list[int] = []
    for i, (seq, n) in enumerate(zip(seqs, sched.num_scheduled)):
        start = seq.num_computed_tokens
        table = kv.block_table(seq.seq_id)
        for pos in range(start, start + n):
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
        query_start_loc.append(query_start_loc[-1] + n)
        seq_lens.append(start + n)
        context_lens.append(start)
        tables.append(table)
        if start + n == seq.num_tokens:
            sampled_rows.append(i)
            logits_indices.append(query_start_loc[-1] - 1)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return {
        "input_ids": torch.tensor(input_ids, dtype=torch.int64, device=device),
        "positions": torch.tensor(positions, dtype=torch.int64, device=device),
        "slot_mapping": torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        "query_start_loc": torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "context_lens": torch.tensor(context_lens, dtype=torch.int32, device=device),
        "block_tables": torch.tensor(padded, dtype=torch.int32, device=device),
        "sampled_rows": sampled_rows,
        "logits_indices": logits_indices,
    }


def check_same(corerun_out: tuple[Any, Any, Any], base: dict[str, Any]) -> None:
    """Raise AssertionError unless both builders produced the same inputs."""
    inputs, rows, logits_indices = corerun_out
    b = inputs.batch
    got = {
        "input_ids": inputs.input_ids, "positions": inputs.positions, "slot_mapping": b.slot_mapping,
        "query_start_loc": b.query_start_loc, "seq_lens": b.seq_lens, "context_lens": b.context_lens,
        "block_tables": b.block_tables,
    }
    for key, value in got.items():
        ref = base[key]
        if value.dtype != ref.dtype or value.shape != ref.shape or not torch.equal(value.cpu(), ref.cpu()):
            raise AssertionError(f"prepare_inputs and the baseline disagree on {key}: {value} vs {ref}")
    if rows.tolist() != base["sampled_rows"] or logits_indices.tolist() != base["logits_indices"]:
        raise AssertionError("prepare_inputs and the baseline disagree on the sampled rows / logits indices")


# ----------------------------------------------------------------------------- the setup
def build_engine(model_dir: Path, num_seqs: int, context_len: int, block_size: int, extra_tokens: int, device: str) -> LLMEngine:
    """A production engine on the tiny model, with room for ``num_seqs`` sequences of ``context_len + extra_tokens``."""
    blocks = num_seqs * -(-(context_len + extra_tokens + 1) // block_size) + 16
    cfg = load_config(
        None,
        overrides={
            "model": str(model_dir), "device": device, "dtype": "float32", "attention": "torch", "graph": {"runner": "eager"},
            "kv_cache": {"block_size": block_size, "num_blocks": blocks},
            "scheduler": {"max_num_seqs": max(num_seqs, 1), "max_num_batched_tokens": max(8192, context_len)},
        },
    )
    return LLMEngine(cfg)


def add_prompts(engine: LLMEngine, lengths: list[int], rng: random.Random, max_tokens: int) -> list[Sequence]:
    """Queue one prompt of random tokens per entry of ``lengths``."""
    vocab = engine.runner.vocab_size
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = []
    for n in lengths:
        seq = engine.make_sequence([rng.randrange(vocab) for _ in range(n)], params)
        engine.queue_sequence(seq)
        seqs.append(seq)
    return seqs


def after_step(engine: LLMEngine, sched: ScheduledBatch, sampled_rows: list[int], rng: random.Random) -> None:
    """What the engine does once the model has run: the runner records a random token for each sampled
    row, and the scheduler applies the step's result (computed tokens, prefix-cache blocks, the token)."""
    vocab, ib = engine.runner.vocab_size, engine.runner.input_batch
    tokens = [rng.randrange(vocab) for _ in sampled_rows]
    for row, token in zip(sampled_rows, tokens):
        ib.record(ib.index[sched.req_ids[row]], [token])
    _, failed = engine.scheduler.update_from_output(sched, StepResult(tokens, list(sampled_rows), None, {}))
    if failed:
        raise AssertionError(f"the scheduler failed to apply a step's result: {failed}")


def timed_step(engine: LLMEngine, step: int) -> tuple[ScheduledBatch, list[int], float, float, float]:
    """One step's schedule, then both builders in alternating order; returns the batch, its sampled rows
    and three times (s)."""
    runner = engine.runner
    t0 = CLOCK()
    sched = engine.scheduler.schedule()
    t1 = CLOCK()
    seqs = engine.scheduler.seqs_of(sched)  # (the baseline's view: the live sequences, untimed)
    times = {}
    order = ("corerun", "baseline") if step % 2 == 0 else ("baseline", "corerun")
    outs: dict[str, Any] = {}
    for name in order:
        s = CLOCK()
        if name == "corerun":
            outs[name] = runner.prepare_inputs(sched)
        else:
            outs[name] = baseline_prepare(sched, seqs, engine.kv, runner.block_size, runner.device)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        times[name] = CLOCK() - s
    check_same(outs["corerun"], outs["baseline"])  # every step: the persistent batch must not drift
    return sched, outs["baseline"]["sampled_rows"], t1 - t0, times["corerun"], times["baseline"]


def bench_decode(model_dir: Path, num_seqs: int, context_len: int, args: argparse.Namespace, kind: str = "decode") -> dict[str, Any]:
    rng = random.Random(num_seqs)
    total = args.warmup + args.steps
    engine = build_engine(model_dir, num_seqs, context_len, args.block_size, total + 1, args.device)
    lengths = [max(context_len - i % args.block_size, 1) for i in range(num_seqs)]  # staggered over one block
    seqs = add_prompts(engine, lengths, rng, max_tokens=total + 8)
    # untimed: prefill every prompt in one step (a budget for all of them), applied to the runner's
    # persistent batch without building its inputs
    budget = engine.scheduler.max_num_batched_tokens
    engine.scheduler.max_num_batched_tokens = sum(lengths)
    first = engine.scheduler.schedule()
    engine.runner.input_batch.apply(first)
    after_step(engine, first, list(range(len(first.req_ids))), rng)
    engine.scheduler.max_num_batched_tokens = budget
    if [s.num_computed_tokens for s in seqs] != lengths or engine.scheduler.waiting:
        raise AssertionError("the setup prefill did not bring every sequence to its context length")
    rows = []
    for step in range(total):
        sched, sampled, t_sched, t_core, t_base = timed_step(engine, step)
        if sched.num_decodes != num_seqs or len(sched.req_ids) != num_seqs:
            raise AssertionError(f"expected a decode step of {num_seqs} sequences, got {sched.num_decodes} decodes of {len(sched.req_ids)}")
        if step >= args.warmup:
            rows.append((t_sched, t_core, t_base))
        after_step(engine, sched, sampled, rng)
    return summarize(kind, num_seqs, num_seqs, context_len, rows)


def bench_prefill(model_dir: Path, num_seqs: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(10_000 + num_seqs)
    engine = build_engine(model_dir, num_seqs, args.context_len, args.block_size, 1, args.device)
    rows = []
    for step in range(args.warmup + args.steps):
        # each step a first prefill of fresh random prompts (no prefix-cache hits); the previous step's
        # requests ended with their one token, so this step's message also drops their rows, and their
        # cached blocks are evicted for this step's prompts
        add_prompts(engine, [args.context_len] * num_seqs, rng, max_tokens=1)
        sched, sampled, t_sched, t_core, t_base = timed_step(engine, step)
        if sched.num_tokens != num_seqs * args.context_len or len(sched.new_reqs) != num_seqs:
            raise AssertionError(f"expected one prefill step of {num_seqs} new requests, {num_seqs * args.context_len} "
                                 f"tokens; got {len(sched.new_reqs)} new requests, {sched.num_tokens} tokens")
        if step >= args.warmup:
            rows.append((t_sched, t_core, t_base))
        after_step(engine, sched, sampled, rng)
        if engine.scheduler.has_unfinished():
            raise AssertionError("a prefill step's requests (max_tokens=1) did not all finish")
    return summarize("prefill", num_seqs, num_seqs * args.context_len, args.context_len, rows)


def summarize(kind: str, num_seqs: int, num_tokens: int, context_len: int, rows: list[tuple[float, float, float]]) -> dict[str, Any]:
    med = lambda i: statistics.median(r[i] for r in rows) * 1e6  # noqa: E731  (microseconds)
    mean = lambda i: statistics.fmean(r[i] for r in rows) * 1e6  # noqa: E731
    sched_us, core_us, base_us = med(0), med(1), med(2)
    step_core = statistics.median((r[0] + r[1]) for r in rows) * 1e6
    step_base = statistics.median((r[0] + r[2]) for r in rows) * 1e6
    return {
        "scenario": kind, "num_seqs": num_seqs, "num_tokens": num_tokens, "context_len": context_len, "steps": len(rows),
        "schedule_us": sched_us, "prepare_corerun_us": core_us, "prepare_baseline_us": base_us,
        "prepare_ratio": base_us / core_us,
        "prepare_corerun_mean_us": mean(1), "prepare_baseline_mean_us": mean(2), "prepare_mean_ratio": mean(2) / mean(1),
        "step_corerun_us": step_core, "step_baseline_us": step_base, "step_ratio": step_base / step_core,
    }


def render(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"host cost of one step (median over {args.steps} steps, µs), block size {args.block_size}, device {args.device}")
    for col in ("scenario", "seqs", "tokens", "schedule", "prep corerun", "prep baseline", "ratio", "mean ratio",
                "step corerun", "step baseline", "step ratio"):
        table.add_column(col, justify="left" if col == "scenario" else "right", no_wrap=True)
    for r in results:
        table.add_row(
            f"{r['scenario']} @ {r['context_len']}", str(r["num_seqs"]), str(r["num_tokens"]), f"{r['schedule_us']:.0f}",
            f"{r['prepare_corerun_us']:.0f}", f"{r['prepare_baseline_us']:.0f}", f"{r['prepare_ratio']:.2f}x",
            f"{r['prepare_mean_ratio']:.2f}x", f"{r['step_corerun_us']:.0f}", f"{r['step_baseline_us']:.0f}", f"{r['step_ratio']:.2f}x",
        )
    console = Console()
    if console.width < 140:
        console = Console(width=140)
    console.print(table)
    console.print("prep: ModelRunner.prepare_inputs vs the per-token Python-list baseline on the same batch; "
                  "ratio = baseline / corerun (of the medians; mean ratio: of the means); step = schedule + prep")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="1,8,64,256", help="decode batch sizes (comma-separated) [1,8,64,256]")
    p.add_argument("--long", default="256x16384,32x131072",
                   help="long-context decode scenarios, SEQSxCONTEXT comma-separated; empty to skip [256x16384,32x131072]")
    p.add_argument("--prefill-seqs", default="1,16", help="prefill batch sizes; empty to skip [1,16]")
    p.add_argument("--context-len", type=int, default=512, help="tokens in the cache per sequence (decode), prompt length (prefill)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=50, help="measured steps per scenario")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured steps first")
    p.add_argument("--device", default="cpu", help="where prepared tensors go (cpu, cuda)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: time.perf_counter; cpu: this thread's CPU time (time.thread_time), which time spent "
                        "waiting for a core on a shared machine does not inflate [wall]")
    args = p.parse_args(argv)
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    seqs = [int(s) for s in args.seqs.split(",") if s.strip()]
    prefill = [int(s) for s in args.prefill_seqs.split(",") if s.strip()]
    try:
        long = [(int(n), int(c)) for n, c in (item.lower().split("x") for item in args.long.split(",") if item.strip())]
    except ValueError:
        p.error(f"--long takes SEQSxCONTEXT pairs separated by commas (e.g. 256x16384,32x131072), got {args.long!r}")

    from tests.helpers.tiny_models import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        longest = max([args.context_len] + [c for _, c in long]) + args.warmup + args.steps + 64
        model_dir = make_tiny_model(tmp, "llama", max_position_embeddings=max(longest, 256))
        results = [bench_decode(model_dir, n, args.context_len, args) for n in seqs]
        results += [bench_decode(model_dir, n, c, args, kind="long decode") for n, c in long]
        results += [bench_prefill(model_dir, n, args) for n in prefill]
    if args.json:
        print(json.dumps({"block_size": args.block_size, "device": args.device, "results": results}, indent=2))
    else:
        render(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
