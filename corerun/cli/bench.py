"""``corerun bench``: offline throughput and latency on the standard random-token workload.

    corerun bench                                   # CPU: 16 seqs, input 32:128, output 16:64
    corerun bench --num-seqs 256 --input-len 100:1024 --output-len 100:1024 --compare hf --json
    corerun bench --num-seqs 32 --input-len 32:256 --output-len 32:256 --compare hf,llama.cpp,vllm --rounds 2
    corerun bench --async-scheduling both --rounds 3  # synchronous vs asynchronous scheduling, interleaved

Without ``--compare`` corerun runs in this process.  With it, corerun and every peer run in fresh
processes of their own, interleaved (corerun.bench.compare); peers come from benchmarks/peers/setup.sh.
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
@click.option("--compare", metavar="PEERS", default=None,
              help="Also run these peers, comma-separated: hf (transformers), llama.cpp, vllm; each engine in its own process.")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --compare (or --async-scheduling both): interleaved rounds (corerun, peers, corerun, peers, ...); each engine's fastest is reported.")
@click.option("--peer-python", "peer_pythons", multiple=True, metavar="NAME=PATH",
              help="With --compare: the interpreter of a peer's virtualenv [benchmarks/peers/.venvs/NAME/bin/python].")
@click.option("--baseline-env", "baseline_env", multiple=True, metavar="NAME=VALUE",
              help="With --compare: also run corerun with this environment variable set (corerun-baseline), e.g. CORERUN_CPU_PREPACK=0 for a before/after.")
@click.option("--gguf", "gguf_path", type=click.Path(dir_okay=False, exists=True), default=None,
              help="With --compare llama.cpp: the GGUF file of the model in the run's dtype [the default model's, from benchmarks/peers/setup.sh].")
@click.option("--hf-batching", type=click.Choice(["batched", "per-prompt"]), default="batched", show_default=True,
              help="HF: left-padded batches (as vLLM's benchmark_throughput), or one generate per request.")
@click.option("--hf-batch-size", type=click.IntRange(min=1), default=None, help="HF: requests per batch [all of them].")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads of every engine (corerun's `threads` setting) [the config's threads: the physical cores]. On a busy machine 1 is steadier.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout instead of a table.")
@click.option("--url", default=None, help="Online mode: benchmark this running server (corerun serve or any OpenAI-compatible one) instead (corerun.server.bench_client).")
@click.option("--request-rate", type=float, default=float("inf"), help="Online mode: requests per second, Poisson arrivals [inf: all at once].")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None, help="Online mode: requests in flight at most [no limit].")
@click.option("--async-scheduling", "async_mode", type=click.Choice(["on", "off", "both"]), default=None,
              help="scheduler.async_scheduling for this run; both: one engine runs the workload synchronously and "
                   "asynchronously in turn for --rounds rounds and reports the speed-up [the config's].")
def bench(
    config_path, sets, model, attention, sampler, device, dtype,
    num_seqs, input_len, output_len, seed, temperature, warmup, compare, rounds, peer_pythons, baseline_env, gguf_path,
    hf_batching, hf_batch_size, threads, as_json, url=None, request_rate=float("inf"), max_concurrency=None,
    async_mode=None,
) -> None:
    """Throughput and latency of corerun on N random-token requests (ignore_eos, exact output lengths).

    Reports output and total tokens/s, time to first token and time per output token (median, p90,
    p99), peak memory, the backends that ran and the thread count; with --compare, the same for each
    peer, the ratios, and the load average before each run.
    """
    import torch

    from corerun.bench.workload import parse_range

    try:
        ranges = [parse_range(r) if r is not None else None for r in (input_len, output_len)]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--input-len / --output-len") from None
    if async_mode is not None and (url is not None or (async_mode == "both" and (compare or baseline_env))):
        raise click.BadParameter(
            f"--async-scheduling {async_mode} sets up corerun in this process"
            + (" or its --compare process; a server started with --url has its own config" if url is not None
               else "; leave out --compare / --baseline-env with both"),
            param_hint="--async-scheduling",
        )
    if async_mode in ("on", "off"):
        sets = (*sets, f"scheduler.async_scheduling={'true' if async_mode == 'on' else 'false'}")
    if url is not None:  # online mode: a running server (corerun.server.bench_client)
        from corerun.server.bench_client import run_cli

        return run_cli(url, num_seqs, ranges, request_rate, max_concurrency, seed, temperature, as_json)
    cfg_args = dict(model=model, attention=attention, sampler=sampler, device=device, dtype=dtype, threads=threads)
    hf_args = dict(batching=hf_batching, batch_size=hf_batch_size)
    if compare or baseline_env:
        from corerun.bench.compare import parse_compare, parse_env, parse_peer_pythons

        try:
            peers, pythons, env = parse_compare(compare), parse_peer_pythons(peer_pythons), parse_env(baseline_env)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--compare / --peer-python / --baseline-env") from None
        try:
            doc = _run_compare(config_path, sets, cfg_args, num_seqs, ranges, seed, temperature, warmup, hf_args,
                               peers, pythons, env, rounds, gguf_path, quiet=as_json)
        except (CorerunError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
        if as_json:
            click.echo(json.dumps(doc, indent=2))
        else:
            from corerun.bench.compare import render_compare

            render_compare(doc)
        return
    saved_threads = torch.get_num_threads()
    try:
        if async_mode == "both":
            doc = _run_async_both(config_path, sets, cfg_args, num_seqs, ranges, seed, temperature, warmup, rounds, as_json)
        else:
            doc = _run(config_path, sets, cfg_args, num_seqs, ranges, seed, temperature, warmup)
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
        if "async_scheduling" in doc:
            _render_async(doc)


def _workload_for(cfg: Any, num_seqs: int | None, ranges: list[Any], seed: int, vocab_size: int, max_model_len: int, device_type: str) -> Any:
    from corerun.bench.workload import make_workload

    d_seqs, d_in, d_out = DEFAULTS["cuda" if device_type == "cuda" else "cpu"]
    workload = make_workload(num_seqs or d_seqs, ranges[0] or d_in, ranges[1] or d_out, seed, vocab_size)
    longest = workload.input_len.hi + workload.output_len.hi
    if longest > max_model_len:
        raise click.BadParameter(
            f"input {workload.input_len} + output {workload.output_len} can reach {longest} tokens, but this model's "
            f"max_model_len is {max_model_len}; shorten the ranges",
            param_hint="--input-len / --output-len",
        )
    return workload


def _run(
    config_path: str | None, sets: tuple[str, ...], cfg_args: dict[str, Any], num_seqs: int | None,
    ranges: list[Any], seed: int, temperature: float, warmup: bool,
) -> dict[str, Any]:
    """Load corerun in this process and run the workload; the report document."""
    from corerun.bench.corerun_run import load_corerun, run_corerun
    from corerun.bench.report import build_report

    cfg = build_config(config_path, sets, **cfg_args)
    llm, meter, load_s = load_corerun(cfg)
    runner = llm.engine.runner
    workload = _workload_for(cfg, num_seqs, ranges, seed, runner.vocab_size, runner.max_model_len, runner.device.type)
    core = run_corerun(llm, workload, meter, load_s, temperature=temperature, warmup=warmup)
    return build_report(workload, core, temperature=temperature, warmup=warmup)


def _run_async_both(
    config_path: str | None, sets: tuple[str, ...], cfg_args: dict[str, Any], num_seqs: int | None,
    ranges: list[Any], seed: int, temperature: float, warmup: bool, rounds: int, quiet: bool,
) -> dict[str, Any]:
    """One engine runs the workload synchronously and asynchronously in turn (the order alternating
    each round); the report of its fastest asynchronous run, with both modes' throughputs and the speed-up."""
    import os

    from corerun.bench.corerun_run import load_corerun, run_corerun
    from corerun.bench.report import build_report, same_outputs

    cfg = build_config(config_path, (*sets, "scheduler.async_scheduling=true"), **cfg_args)  # refused where unsupported
    llm, meter, load_s = load_corerun(cfg)
    runner = llm.engine.runner
    workload = _workload_for(cfg, num_seqs, ranges, seed, runner.vocab_size, runner.max_model_len, runner.device.type)
    runs: dict[str, list[Any]] = {"sync": [], "async": []}
    loads: list[float] = []
    for r in range(rounds):
        for mode in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
            llm.engine.set_async_scheduling(mode == "async")
            loads.append(os.getloadavg()[0])
            run = run_corerun(llm, workload, meter, load_s, temperature=temperature, warmup=warmup and r == 0)
            runs[mode].append(run)
            if not quiet:
                click.echo(f"round {r + 1}/{rounds} {mode}: {run.output_tokens_per_s:.1f} output tok/s "
                           f"(load {loads[-1]:.2f})", err=True)
    llm.shutdown()
    best = {mode: max(rs, key=lambda x: x.output_tokens_per_s) for mode, rs in runs.items()}
    doc = build_report(workload, best["async"], temperature=temperature, warmup=warmup)
    tps = {mode: [x.output_tokens_per_s for x in rs] for mode, rs in runs.items()}
    doc["async_scheduling"] = {
        "rounds": rounds,
        "sync_output_tokens_per_s": tps["sync"],
        "async_output_tokens_per_s": tps["async"],
        "speedup": best["async"].output_tokens_per_s / best["sync"].output_tokens_per_s,
        "speedup_per_round": [a / s for a, s in zip(tps["async"], tps["sync"])],
        "same_outputs": same_outputs(best["async"].output_token_ids, best["sync"].output_token_ids),
        "loadavg_before_runs": loads,
    }
    return doc


def _render_async(doc: dict[str, Any]) -> None:
    a = doc["async_scheduling"]
    n, greedy = doc["workload"]["num_seqs"], doc["workload"]["temperature"] == 0
    click.echo(
        f"async scheduling: {max(a['async_output_tokens_per_s']):.1f} output tok/s, synchronous "
        f"{max(a['sync_output_tokens_per_s']):.1f} (fastest of {a['rounds']} interleaved rounds each): "
        f"{a['speedup']:.3f}x; per round " + ", ".join(f"{x:.3f}x" for x in a["speedup_per_round"])
        + (f"; outputs identical for {a['same_outputs']} of {n} requests" if greedy else "")
    )


def _run_compare(
    config_path: str | None, sets: tuple[str, ...], cfg_args: dict[str, Any], num_seqs: int | None,
    ranges: list[Any], seed: int, temperature: float, warmup: bool, hf_args: dict[str, Any],
    peers: list[str], pythons: dict[str, Any], env: dict[str, str], rounds: int, gguf_path: str | None, quiet: bool,
) -> dict[str, Any]:
    """corerun and ``peers`` in fresh processes, ``rounds`` interleaved rounds; the comparison document."""
    import os
    from pathlib import Path

    from corerun.bench.compare import BASELINE, PeerError, build_compare_report, build_request, compare, find_gguf, find_python
    from corerun.bench.report import base_report
    from corerun.runner.model_runner import resolve_device, resolve_dtype
    from corerun.models.config import ModelConfig
    from corerun.threads import resolve_threads

    cfg = build_config(config_path, sets, **cfg_args)
    if resolve_device(cfg.device).type != "cpu":
        raise click.BadParameter("the peers run on CPU (vLLM's CPU build, llama.cpp): use --device cpu", param_hint="--compare")
    if cfg.model:
        model_dir = Path(cfg.model)
    else:
        from corerun.models.default import default_model_dir

        model_dir = default_model_dir()
    mc = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text(encoding="utf-8")))
    max_len = mc.max_model_len if cfg.scheduler.max_model_len == "auto" else cfg.scheduler.max_model_len
    workload = _workload_for(cfg, num_seqs, ranges, seed, mc.vocab_size, max_len, "cpu")
    dtype = str(resolve_dtype(cfg.dtype, resolve_device("cpu"), mc.torch_dtype)).removeprefix("torch.")
    threads = resolve_threads(cfg.threads)
    common = dict(model_dir=str(model_dir), dtype=dtype, threads=threads, temperature=temperature, warmup=warmup,
                  max_model_len=min(max_len, workload.input_len.hi + workload.output_len.hi + 16), vocab_size=mc.vocab_size)
    gguf = find_gguf(dtype, Path(gguf_path) if gguf_path else None) if not cfg.model or gguf_path else None
    options = {
        "corerun": {"config_path": config_path, "sets": list(sets), "overrides": {k: v for k, v in cfg_args.items() if v is not None and k not in ("dtype", "threads")}},
        "hf": hf_args,
        "llama.cpp": {},
        "vllm": {},
    }
    options[BASELINE] = options["corerun"]
    engines, skipped, pyths = ["corerun"], {}, {}
    for name in ["corerun", *([BASELINE] if env else []), *peers]:
        try:
            pyths[name] = find_python(name, pythons)
            if name == "llama.cpp" and gguf is None:
                raise PeerError(f"llama.cpp needs the model as GGUF in {dtype}: pass --gguf PATH (setup.sh makes the default model's)")
        except PeerError as exc:
            skipped[name] = str(exc)
            continue
        if name != "corerun":
            engines.append(name)
    requests = {name: build_request(name, workload, gguf=gguf if name == "llama.cpp" else None, options=options[name],
                                    env=env if name == BASELINE else None, **common) for name in engines}

    def progress(name: str, r: int, run: Any, error: str | None) -> None:
        if quiet:
            return
        what = f"{run.output_tokens_per_s:.1f} output tok/s" if run else f"failed: {error.splitlines()[0]}"  # type: ignore[union-attr]
        click.echo(f"round {r + 1}/{rounds} {name}: {what} (load {os.getloadavg()[0]:.2f})", err=True)

    results = compare(engines, requests, pyths, workload, rounds=rounds, on_run=progress)
    base = base_report(workload, temperature=temperature, warmup=warmup)
    doc = build_compare_report(results, base)
    doc["skipped"] = {**skipped, **doc["skipped"]}
    doc.update(dtype=dtype, threads=threads, rounds=rounds, loadavg_after=list(os.getloadavg()))
    return doc
