"""``corerun bench``: offline throughput and latency on the standard random-token workload.

    corerun bench                                   # CPU: 16 seqs, input 32:128, output 16:64
    corerun bench --num-seqs 256 --input-len 100:1024 --output-len 100:1024 --compare hf --json
"""

from __future__ import annotations

import json
import re
from typing import Any

import click

from corerun.cli.options import build_config, engine_options
from corerun.errors import CorerunError

# (num_seqs, input_len, output_len) when not given: nano-vllm's bench.py on a GPU; on CPU a run
# of the default model that takes about a minute on 2 cores (benchmarks/RESULTS.md)
DEFAULTS = {"cuda": (256, "100:1024", "100:1024"), "cpu": (16, "32:128", "16:64")}
RANGE_FLAGS = ("--input-len", "--output-len")
_INT = re.compile(r"^\d+$")


class _BenchCommand(click.Command):
    """Accepts ``--input-len 32 128`` (two integers) as well as ``--input-len 32:128``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        joined: list[str] = []
        i = 0
        while i < len(args):
            a = args[i]
            if a in RANGE_FLAGS and i + 2 < len(args) and _INT.match(args[i + 1]) and _INT.match(args[i + 2]):
                joined += [a, f"{args[i + 1]}:{args[i + 2]}"]
                i += 3
                continue
            joined.append(a)
            i += 1
        return super().parse_args(ctx, joined)


@click.command(cls=_BenchCommand)
@engine_options
@click.option("--num-seqs", type=click.IntRange(min=1), default=None, help="Number of requests [CPU: 16, CUDA: 256].")
@click.option("--input-len", metavar="MIN:MAX", default=None, help="Prompt lengths, drawn uniformly (MIN:MAX, MIN MAX, or one length) [CPU: 32:128, CUDA: 100:1024].")
@click.option("--output-len", metavar="MIN:MAX", default=None, help="Output lengths, drawn uniformly [CPU: 16:64, CUDA: 100:1024].")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the workload (lengths and token ids).")
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="0 means greedy.")
@click.option("--warmup/--no-warmup", default=True, show_default=True, help="One short request before the measured run.")
@click.option("--compare", type=click.Choice(["hf"]), default=None, help="Also run Hugging Face transformers' generate and print the ratio.")
@click.option("--hf-batching", type=click.Choice(["batched", "per-prompt"]), default="batched", show_default=True,
              help="HF: left-padded batches (as vLLM's benchmark_throughput), or one generate per request.")
@click.option("--hf-batch-size", type=click.IntRange(min=1), default=None, help="HF: requests per batch [all of them].")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for torch (torch.set_num_threads), both engines [torch's default]. On a busy machine 1 is steadier.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout instead of a table.")
def bench(
    config_path, sets, model, attention, sampler, device, dtype,
    num_seqs, input_len, output_len, seed, temperature, warmup, compare, hf_batching, hf_batch_size, threads, as_json,
) -> None:
    """Throughput and latency of corerun on N random-token requests (ignore_eos, exact output lengths).

    Reports output and total tokens/s, time to first token and time per output token (median, p90,
    p99), peak memory, and the backends that ran.
    """
    import torch

    from corerun.bench.workload import parse_range

    try:
        ranges = [parse_range(r) if r is not None else None for r in (input_len, output_len)]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--input-len / --output-len") from None
    cfg_args = dict(model=model, attention=attention, sampler=sampler, device=device, dtype=dtype)
    hf_args = dict(batching=hf_batching, batch_size=hf_batch_size) if compare == "hf" else None
    saved_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        doc = _run(config_path, sets, cfg_args, num_seqs, ranges, seed, temperature, warmup, hf_args)
    except CorerunError as exc:
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        torch.set_num_threads(saved_threads)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        from corerun.bench.report import render

        render(doc)


def _run(
    config_path: str | None, sets: tuple[str, ...], cfg_args: dict[str, Any], num_seqs: int | None,
    ranges: list[Any], seed: int, temperature: float, warmup: bool, hf_args: dict[str, Any] | None,
) -> dict[str, Any]:
    """Load corerun, run the workload (then transformers' when ``hf_args``); the report document."""
    from corerun.bench.corerun_run import load_corerun, run_corerun
    from corerun.bench.report import build_report
    from corerun.bench.workload import make_workload
    from corerun.model_runner import resolve_device

    cfg = build_config(config_path, sets, **cfg_args)
    dev = resolve_device(cfg.device)
    d_seqs, d_in, d_out = DEFAULTS["cuda" if dev.type == "cuda" else "cpu"]
    input_len, output_len = ranges[0] or d_in, ranges[1] or d_out
    llm, meter, load_s = load_corerun(cfg)
    runner = llm.engine.runner
    workload = make_workload(num_seqs or d_seqs, input_len, output_len, seed, runner.vocab_size)
    longest = workload.input_len.hi + workload.output_len.hi
    if longest > runner.max_model_len:
        raise click.BadParameter(
            f"input {workload.input_len} + output {workload.output_len} can reach {longest} tokens, but this model's "
            f"max_model_len is {runner.max_model_len}; shorten the ranges",
            param_hint="--input-len / --output-len",
        )
    core = run_corerun(llm, workload, meter, load_s, temperature=temperature, warmup=warmup)
    hf = None
    if hf_args is not None:
        from corerun.bench.hf_run import run_hf

        model_dir, hf_dtype = runner.model_dir, runner.dtype
        del llm, runner  # frees corerun's KV cache before transformers loads (on a GPU it holds most memory)
        hf = run_hf(model_dir, workload, dtype=hf_dtype, device=dev, temperature=temperature, warmup=warmup, **hf_args)
    return build_report(workload, core, hf, temperature=temperature, warmup=warmup)
