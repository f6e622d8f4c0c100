"""Time one sampling step of the ``full`` sampler against a straightforward sort-based sampler, and
its penalties with per-request history caching (``seq_ids``) against without.

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
steady state: each step appends one token to every output (histories are ``TokenView``s over a growing
list, as the engine passes them), and the same step is sampled by a ``full`` sampler given the
requests' ``seq_ids`` (its history cache warm) and by one given ``seq_ids=None`` (stateless: the whole
history goes from lists to the device every step).  It times the penalty stage alone
(``apply_penalties``) and whole steps of greedy and of sampled (top-k 50, top-p 0.95) rows; greedy tokens and the penalised
logits must agree between the two (checked).

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

import torch

from corerun.core.sequence import TokenView
from corerun.protocols import SamplingMetadata
from corerun.sampling_params import SamplingParams
from corerun.sampler.history_cache import HistoryCache
from corerun.sampler.penalties import apply_penalties
from corerun.sampler.full import FullSampler

KINDS = [
    SamplingParams(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1),
    SamplingParams(temperature=1.0, top_p=0.95, frequency_penalty=0.3, presence_penalty=0.2),
    SamplingParams(temperature=0.8, top_k=20, min_p=0.05),
    SamplingParams(temperature=0.0, repetition_penalty=1.05),
]


def baseline_sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The straightforward pipeline: dense penalties, softmax min-p, full sort for top-k / top-p."""
    params, (batch, vocab), dev = md.params, logits.shape, logits.device
    x = logits.to(torch.float32, copy=True)

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
    """Steady-state steps with and without ``seq_ids``; see the module docstring."""
    batch, vocab = args.penalty_batch, args.vocab
    gen = torch.Generator().manual_seed(7)
    histories = torch.randint(0, vocab, (batch, args.prompt_len + args.output_len), generator=gen).tolist()
    views = [TokenView(tokens, args.prompt_len) for tokens in histories]
    prompts = [tokens[: args.prompt_len] for tokens in histories]
    seq_ids = list(range(batch))
    penalties = {"repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.2}
    kinds = {
        "greedy step": SamplingParams(temperature=0.0, **penalties),
        "sampled step": SamplingParams(temperature=0.8, top_k=50, top_p=0.95, **penalties),
    }
    rep, freq, pres = ([v] * batch for v in penalties.values())
    print(f"\npenalties: batch {batch}, prompts {args.prompt_len}, outputs {args.output_len}+ tokens, "
          f"one new token per step, {args.steps} timed steps")
    print(f"{'':>16} {'seq_ids ms':>11} {'stateless ms':>13} {'ratio':>7}")

    def timed(fn) -> float:
        return timed_ms(fn, device)

    def pair(cached, stateless, step: int) -> tuple[float, float]:
        """Both timings, in alternating order from step to step."""
        if step % 2:
            plain_ms = timed(stateless)
            return timed(cached), plain_ms
        cached_ms = timed(cached)
        return cached_ms, timed(stateless)

    rows = ["penalty stage", *kinds]
    times: dict[str, tuple[list[float], list[float]]] = {row: ([], []) for row in rows}
    cache = HistoryCache()
    samplers = {row: (FullSampler(vocab, device), FullSampler(vocab, device)) for row in kinds}  # (seq_ids, stateless)
    for step in range(args.steps + 1):  # step 0 fills the caches, untimed
        for tokens in histories:
            tokens.append(int(torch.randint(0, vocab, (1,), generator=gen)))
        logits = (torch.randn(batch, vocab, generator=gen) * 3).to(device)
        with_ids, without = logits.clone(), logits.clone()
        results = [pair(lambda: apply_penalties(with_ids, prompts, views, rep, freq, pres, cache, seq_ids),
                        lambda: apply_penalties(without, prompts, views, rep, freq, pres), step)]
        if not torch.equal(with_ids, without):
            raise SystemExit(f"step {step}: the penalty stage differs with and without seq_ids")
        for row, params in kinds.items():
            md = SamplingMetadata([params] * batch, prompts, views, frozenset({0}), seq_ids=seq_ids)
            plain_md = SamplingMetadata([params] * batch, prompts, views, frozenset({0}))
            ours, plain = samplers[row]
            out: dict[str, torch.Tensor] = {}
            results.append(pair(lambda: out.setdefault("ids", ours.sample(logits, md).sampled_token_ids),
                                lambda: out.setdefault("none", plain.sample(logits, plain_md).sampled_token_ids), step))
            if params.greedy and not torch.equal(out["ids"], out["none"]):
                raise SystemExit(f"step {step}: greedy tokens differ with and without seq_ids")
        if step:
            for row, (c, p) in zip(rows, results):
                times[row][0].append(c)
                times[row][1].append(p)
    for row in rows:
        cached_ms, plain_ms = (statistics.median(t) for t in times[row])
        print(f"{row:>16} {cached_ms:>11.2f} {plain_ms:>13.2f} {plain_ms / cached_ms:>6.2f}x")


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
