"""Time one sampling step of the ``full`` sampler against a straightforward sort-based sampler, and
its penalties on long histories as the runner hands them (views of its persistent batch).

    .venv/bin/python benchmarks/sampler_bench.py [--vocab 152064] [--batches 1 64 256] [--device cpu] [--threads N]
        [--cases pipeline penalties] [--penalty-batch 64] [--prompt-len 2000] [--output-len 500] [--steps 20]

Both run in the same process on the same logits and histories, batch by batch, and the table gives
the median time per step and the ratio (baseline / full).  The batch mixes four kinds of request:
top-k + top-p + repetition penalty, top-p alone + frequency / presence penalties, top-k + min-p, and
greedy with a repetition penalty; every request has a 256-token prompt and 64 generated tokens.

The baseline is the textbook pipeline (vLLM v1's plain-torch path): dense ``[B, V]`` penalty tensors
from padded histories, min-p through a softmax, one full sort of every row for top-k / top-p, a
softmax, an exponential race.  Greedy rows must agree between the two (checked).

The penalties case runs ``--penalty-batch`` requests with ``--prompt-len``-token prompts and
``--output-len`` generated tokens, every one with repetition, frequency and presence penalties, in
steady state.  The requests live in a ``corerun.runner.input_batch.InputBatch``, as in the runner:
each step records one sampled token per row (``InputBatch.record``) and the ``SamplingMetadata``
carries each row's prompt and output as views of the batch's arrays (``InputBatch.view``), exactly
as ``ModelRunner.prepare_step`` builds it.  The same step is timed three ways, in rotating order:
the ``full`` sampler given those views, the ``full`` sampler given the same histories as plain
Python lists (what a caller without a persistent batch hands), and the dense textbook baseline.
It times the penalty stage alone (``apply_penalties`` against the dense penalties) and whole steps
of greedy and of sampled (top-k 50, top-p 0.95) rows.  Checked every step: the penalised logits are
the same bit for bit from views and from lists and agree with the dense ones to float32 rounding,
and greedy tokens are the same all three ways.

The grammar case (``--cases grammar``) measures what structured output adds to a step on the default
model's 49,152-token vocabulary: a ``full`` sampler step of greedy rows alone, against the same step
after the ``xgrammar`` logits processor masked every row (JSON schema; each row's matcher inside a
string, where most tokens are allowed, or after a key, where few are).  It prints the bitmask fill
(host), the mask itself, and the whole step with and without them; masked greedy tokens must be
allowed by each row's grammar (checked).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from datetime import date

import corerun  # noqa: F401  (before torch: its OpenMP settings, corerun.platform.host)
import torch

from corerun.core.batch import NewRequest, ScheduledBatch
from corerun.protocols import SamplingMetadata
from corerun.runner.input_batch import InputBatch
from corerun.sampling_params import SamplingParams
from corerun.sampler.penalties import apply_penalties
from corerun.sampler.full import FullSampler

KINDS = [
    SamplingParams(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1),
    SamplingParams(temperature=1.0, top_p=0.95, frequency_penalty=0.3, presence_penalty=0.2),
    SamplingParams(temperature=0.8, top_k=20, min_p=0.05),
    SamplingParams(temperature=0.0, repetition_penalty=1.05),
]


def baseline_penalties(x: torch.Tensor, md: SamplingMetadata) -> None:
    """Repetition, frequency and presence penalties in place on float32 ``x`` ``[B, V]``, the dense way:
    ``[B, V]`` token counts from padded histories."""
    params, (batch, vocab), dev = md.params, x.shape, x.device

    def padded(seqs) -> torch.Tensor:
        width = max(1, max(len(s) for s in seqs))
        return torch.tensor([list(s) + [vocab] * (width - len(s)) for s in seqs], device=dev)

    def counts(seqs) -> torch.Tensor:
        tokens = padded(seqs)
        c = torch.zeros(batch, vocab + 1, device=dev).scatter_add_(1, tokens, torch.ones(tokens.shape, device=dev))
        return c[:, :vocab]

    col = lambda values: torch.tensor(values, dtype=torch.float32, device=dev)[:, None]  # noqa: E731
    out_counts = counts(md.output_token_ids)
    seen = (counts(md.prompt_token_ids) > 0) | (out_counts > 0)
    rep = torch.where(seen, col([p.repetition_penalty for p in params]), 1.0)
    x *= torch.where(x > 0, 1.0 / rep, rep)
    x -= col([p.frequency_penalty for p in params]) * out_counts
    x -= col([p.presence_penalty for p in params]) * (out_counts > 0)


def baseline_sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The straightforward pipeline: dense penalties, softmax min-p, full sort for top-k / top-p."""
    params, (batch, vocab), dev = md.params, logits.shape, logits.device
    x = logits.to(torch.float32, copy=True)
    col = lambda values: torch.tensor(values, dtype=torch.float32, device=dev)[:, None]  # noqa: E731
    baseline_penalties(x, md)

    greedy = x.argmax(dim=-1)
    x /= col([p.temperature if not p.greedy else 1.0 for p in params])
    probs = x.softmax(dim=-1)
    x[probs < col([p.min_p for p in params]) * probs.amax(dim=-1, keepdim=True)] = float("-inf")

    ordered, index = x.sort(dim=-1)
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)
    kth = ordered.gather(1, (vocab - k)[:, None])
    ordered.masked_fill_(ordered < kth, float("-inf"))
    cum = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1 - col([p.top_p for p in params])
    drop[:, -1] = False
    ordered.masked_fill_(drop, float("-inf"))
    x = ordered.scatter(1, index, ordered)

    probs = x.softmax(dim=-1)
    random = probs.div_(torch.empty_like(probs).exponential_()).argmax(dim=-1)
    is_greedy = torch.tensor([p.greedy for p in params], device=dev)
    return torch.where(is_greedy, greedy, random)


def step_inputs(batch: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, SamplingMetadata]:
    gen = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(device)
    prompts = torch.randint(0, vocab, (batch, 256), generator=gen).tolist()
    outputs = torch.randint(0, vocab, (batch, 64), generator=gen).tolist()
    params = [KINDS[i % len(KINDS)] for i in range(batch)]
    return logits, SamplingMetadata(params, prompts, outputs, frozenset({0}))


def timed_ms(fn, device: torch.device) -> float:
    """One call of ``fn``, in milliseconds, with the device drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def median_ms(fn, repeats: int, device: torch.device) -> float:
    times = [timed_ms(fn, device) for _ in range(repeats + 1)]  # the first run warms up
    return statistics.median(times[1:])


def penalty_case(args: argparse.Namespace, device: torch.device) -> None:
    """Steady-state steps on histories held by an ``InputBatch``; see the module docstring."""
    batch, vocab, prompt_len = args.penalty_batch, args.vocab, args.prompt_len
    gen = torch.Generator().manual_seed(7)
    histories = torch.randint(0, vocab, (batch, prompt_len + args.output_len), generator=gen).tolist()
    penalties = {"repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.2}
    kinds = {
        "greedy step": SamplingParams(temperature=0.0, **penalties),
        "sampled step": SamplingParams(temperature=0.8, top_k=50, top_p=0.95, **penalties),
    }
    ib = InputBatch(block_size=16)
    ib.apply(ScheduledBatch(
        tuple(range(batch)), (1,) * batch, batch,
        new_reqs=tuple(NewRequest(i, tuple(h[:prompt_len]), tuple(h[prompt_len:]), kinds["greedy step"], (), len(h) - 1)
                       for i, h in enumerate(histories)),
    ))
    rows = [ib.index[i] for i in range(batch)]
    prompts = [h[:prompt_len] for h in histories]  # the plain-list copies
    outputs = [h[prompt_len:] for h in histories]
    rep, freq, pres = ([v] * batch for v in penalties.values())
    print(f"\npenalties: batch {batch}, prompts {prompt_len}, outputs {args.output_len}+ tokens, "
          f"one new token per step, {args.steps} timed steps; histories from an InputBatch (views) as the runner hands them")
    print(f"{'':>16} {'views ms':>9} {'lists ms':>9} {'dense ms':>9} {'lists/views':>12} {'dense/views':>12}")

    def rotated(fns: list, step: int) -> list[float]:
        """Each function timed once, starting from a different one each step; times in the given order."""
        times = [0.0] * len(fns)
        for k in range(len(fns)):
            j = (step + k) % len(fns)
            times[j] = timed_ms(fns[j], device)
        return times

    names = ["penalty stage", *kinds]
    times: dict[str, list[list[float]]] = {name: [[], [], []] for name in names}
    samplers = {name: (FullSampler(vocab, device), FullSampler(vocab, device)) for name in kinds}  # (views, lists)
    for step in range(args.steps + 1):  # step 0 warms up, untimed
        for r, out in zip(rows, outputs):
            token = int(torch.randint(0, vocab, (1,), generator=gen))
            ib.record(r, [token])
            out.append(token)
        views = [ib.view(r) for r in rows]
        view_prompts, view_outputs = [v.prompt_token_ids for v in views], [v.output_view() for v in views]
        logits = (torch.randn(batch, vocab, generator=gen) * 3).to(device)
        from_views, from_lists, dense = logits.clone(), logits.clone(), logits.clone()
        dense_md = SamplingMetadata([kinds["greedy step"]] * batch, prompts, outputs, frozenset({0}))
        results = [rotated([lambda: apply_penalties(from_views, view_prompts, view_outputs, rep, freq, pres),
                            lambda: apply_penalties(from_lists, prompts, outputs, rep, freq, pres),
                            lambda: baseline_penalties(dense, dense_md)], step)]
        if not torch.equal(from_views, from_lists):
            raise SystemExit(f"step {step}: the penalty stage differs between views and lists of the same histories")
        if not torch.allclose(from_views, dense, rtol=1e-5, atol=1e-4):
            worst = (from_views - dense).abs().max().item()
            raise SystemExit(f"step {step}: the penalty stage differs from the dense penalties by up to {worst:.3g}")
        for name, params in kinds.items():
            md = SamplingMetadata([params] * batch, view_prompts, view_outputs, frozenset({0}), seq_ids=list(range(batch)))
            list_md = SamplingMetadata([params] * batch, prompts, outputs, frozenset({0}))
            on_views, on_lists = samplers[name]
            got: dict[str, torch.Tensor] = {}
            results.append(rotated([lambda: got.setdefault("views", on_views.sample(logits, md).sampled_token_ids),
                                    lambda: got.setdefault("lists", on_lists.sample(logits, list_md).sampled_token_ids),
                                    lambda: got.setdefault("dense", baseline_sample(logits, list_md))], step))
            if params.greedy and not (torch.equal(got["views"], got["lists"]) and torch.equal(got["views"], got["dense"])):
                raise SystemExit(f"step {step}: greedy tokens differ between views, lists and the dense baseline")
        if step:
            for name, measured in zip(names, results):
                for column, t in zip(times[name], measured):
                    column.append(t)
    for name in names:
        on_views, on_lists, dense_ms = (statistics.median(t) for t in times[name])
        print(f"{name:>16} {on_views:>9.2f} {on_lists:>9.2f} {dense_ms:>9.2f} {on_lists / on_views:>11.2f}x "
              f"{dense_ms / on_views:>11.2f}x")


def grammar_case(args: argparse.Namespace, device: torch.device) -> None:
    """Per-step cost of masking a 49k vocabulary with xgrammar; see the module docstring."""
    from corerun_structured_output.processor import XGrammarProcessor
    from transformers import AutoTokenizer

    from corerun.models.default import default_model_dir

    tok = AutoTokenizer.from_pretrained(str(default_model_dir(progress=False)))
    vocab = 49152
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    params = SamplingParams(temperature=0.0, structured_outputs={"json": schema})
    prefixes = {"inside a string": '{"name": "Jo', "after a key": '{"name": "Jo", "age'}
    sampler = FullSampler(vocab, device)
    print(f"\ngrammar: xgrammar JSON-schema masks, vocab {vocab}, greedy full sampler, median ms per step")
    print(f"{'state':>16} {'batch':>6} {'fill':>8} {'mask':>8} {'step':>8} {'plain':>8} {'overhead':>9}")
    for state, prefix in prefixes.items():
        ids = tok.encode(prefix)
        for batch in args.grammar_batches:
            proc = XGrammarProcessor(vocab, device, tokenizer=tok, eos_token_ids=frozenset({tok.eos_token_id}))
            proc.prepare(params)
            for key in range(batch):
                proc.add_request(key, params, ids)
            rows, keys = list(range(batch)), list(range(batch))
            logits = (torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)) * 3).to(device)
            md = SamplingMetadata([params] * batch, [[1]] * batch, [[]] * batch)
            masked = logits.clone()
            proc.apply(masked, rows, keys)
            for key, token in zip(keys, sampler.sample(masked, md).sampled_token_ids.tolist()):
                matcher = proc._matchers[key]
                if not matcher.accept_token(token):
                    raise SystemExit(f"{state}, batch {batch}: the masked greedy token {token} is not allowed")
                matcher.rollback(1)
            mask = proc._bitmask[:batch]
            repeats = args.repeats or (20 if batch <= 16 else 10)

            def fill() -> None:
                for key in keys:
                    proc._matchers[key].fill_next_token_bitmask(mask, key)

            work = logits.clone()
            t_fill = median_ms(fill, repeats, device)
            t_mask = median_ms(lambda: xgr_apply(work, mask, rows), repeats, device)
            t_step = median_ms(lambda: sampler.sample(_masked(proc, logits, rows, keys), md), repeats, device)
            t_plain = median_ms(lambda: sampler.sample(logits.clone(), md), repeats, device)
            print(f"{state:>16} {batch:>6} {t_fill:>8.2f} {t_mask:>8.2f} {t_step:>8.2f} {t_plain:>8.2f} "
                  f"{t_step / t_plain:>8.2f}x")


def xgr_apply(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, mask, indices=rows)


def _masked(proc, logits: torch.Tensor, rows: list[int], keys: list[int]) -> torch.Tensor:
    out = logits.clone()
    proc.apply(out, rows, keys)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--repeats", type=int, default=0, help="timed runs per batch (default: 20 / 5 / 3 by size)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--cases", nargs="+", choices=["pipeline", "penalties", "grammar"], default=["pipeline", "penalties"])
    ap.add_argument("--grammar-batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--penalty-batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--output-len", type=int, default=500)
    ap.add_argument("--steps", type=int, default=20, help="timed steady-state steps of the penalties case")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sampler = FullSampler(args.vocab, device)

    print(f"corerun sampler_bench  {date.today()}  torch {torch.__version__}  {platform.processor() or platform.machine()}"
          f"  device={device}  threads={torch.get_num_threads()}  vocab={args.vocab}")
    if "penalties" in args.cases:
        penalty_case(args, device)
    if "grammar" in args.cases:
        grammar_case(args, device)
    if "pipeline" not in args.cases:
        return
    print(f"\n{'batch':>6} {'full ms':>10} {'sort-based ms':>14} {'ratio':>7}")
    for batch in args.batches:
        logits, md = step_inputs(batch, args.vocab, device)
        greedy = torch.tensor([p.greedy for p in md.params], device=device)
        ours, base = sampler.sample(logits, md).sampled_token_ids, baseline_sample(logits, md)
        if not torch.equal(ours[greedy], base[greedy]):
            raise SystemExit(f"batch {batch}: greedy rows disagree between the two samplers")
        repeats = args.repeats or (20 if batch <= 8 else 5 if batch <= 64 else 3)
        t_full = median_ms(lambda: sampler.sample(logits, md), repeats, device)
        t_base = median_ms(lambda: baseline_sample(logits, md), repeats, device)
        print(f"{batch:>6} {t_full:>10.1f} {t_base:>14.1f} {t_base / t_full:>6.2f}x")


if __name__ == "__main__":
    main()
