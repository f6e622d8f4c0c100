"""``corerun bench``: offline throughput and latency on the standard random-token workload.

    corerun bench                                   # CPU: 16 seqs, input 32:128, output 16:64
    corerun bench --num-seqs 256 --input-len 100:1024 --output-len 100:1024 --compare hf --json
"""

from __future__ import annotations

import json
import re

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
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout instead of a table.")
def bench(
    config_path, sets, model, attention, sampler, device, dtype,
    num_seqs, input_len, output_len, seed, temperature, warmup, compare, hf_batching, hf_batch_size, as_json,
) -> None:
    """Throughput and latency of corerun on N random-token requests (ignore_eos, exact output lengths).

    Reports output and total tokens/s, time to first token and time per output token (median, p90,
    p99), peak memory, and the backends that ran.
    """
    from corerun.bench.corerun_run import load_corerun, run_corerun
    from corerun.bench.report import build_report, render
    from corerun.bench.workload import make_workload
    from corerun.model_runner import resolve_device

    try:
        cfg = build_config(config_path, sets, model=model, attention=attention, sampler=sampler, device=device, dtype=dtype)
        dev = resolve_device(cfg.device)
        d_seqs, d_in, d_out = DEFAULTS["cuda" if dev.type == "cuda" else "cpu"]
        llm, meter, load_s = load_corerun(cfg)
        runner = llm.engine.runner
        workload = make_workload(num_seqs or d_seqs, input_len or d_in, output_len or d_out, seed, runner.vocab_size)
        longest = workload.input_len.hi + workload.output_len.hi
        if longest > runner.max_model_len:
            raise click.BadParameter(
                f"input {workload.input_len} + output {workload.output_len} can reach {longest} tokens, but this model's "
                f"max_model_len is {runner.max_model_len}; shorten the ranges",
                param_hint="--input-len / --output-len",
            )
        core = run_corerun(llm, workload, meter, load_s, temperature=temperature, warmup=warmup)
        hf = None
        if compare == "hf":
            from corerun.bench.hf_run import run_hf

            model_dir, hf_dtype = runner.model_dir, runner.dtype
            del llm, runner  # frees corerun's KV cache before transformers loads (on a GPU it holds most memory)
            hf = run_hf(model_dir, workload, dtype=hf_dtype, device=dev, batching=hf_batching,
                        batch_size=hf_batch_size, temperature=temperature, warmup=warmup)
        doc = build_report(workload, core, hf, temperature=temperature, warmup=warmup)
    except CorerunError as exc:
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        render(doc)
