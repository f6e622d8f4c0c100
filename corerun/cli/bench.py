"""``corerun bench``: offline throughput and latency on the standard random-token workload.

    corerun bench                                   # CPU: 16 seqs, input 32:128, output 16:64
    corerun bench --num-seqs 256 --input-len 100:1024 --output-len 100:1024 --compare hf --json
    corerun bench --num-seqs 32 --input-len 32:256 --output-len 32:256 --compare hf,llama.cpp,vllm --rounds 2
    corerun bench --async-scheduling both --rounds 3  # synchronous vs asynchronous scheduling, interleaved
    corerun bench --num-seqs 1 --output-len 128 --workload repetitive --speculative both --rounds 3  # n-gram drafts off vs on

Without ``--compare`` corerun runs in this process.  With it, corerun and every peer run in fresh
processes of their own, interleaved (corerun.bench.compare); peers come from benchmarks/peers/setup.sh.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Sequence

import click

from corerun.bench.workload import WORKLOADS
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
              help="With --compare (or --async-scheduling / --speculative both): interleaved rounds (corerun, peers, corerun, peers, ...); each engine's fastest is reported.")
@click.option("--peer-python", "peer_pythons", multiple=True, metavar="NAME=PATH",
              help="With --compare: the interpreter of a peer's virtualenv [benchmarks/peers/.venvs/NAME/bin/python].")
@click.option("--baseline-env", "baseline_env", multiple=True, metavar="NAME=VALUE",
              help="With --compare: also run corerun with this environment variable set (corerun-baseline), e.g. CORERUN_CPU_PREPACK=0 for a before/after.")
@click.option("--gguf", "gguf_path", type=click.Path(dir_okay=False, exists=True), default=None,
              help="With --compare llama.cpp: the GGUF file of the model in the run's dtype [--model itself when it is a .gguf file, else the default model's, from benchmarks/peers/setup.sh].")
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
@click.option("--speculative", "spec_mode", type=click.Choice(["on", "off", "both"]), default=None,
              help="n-gram speculative decoding (speculative.method: ngram) for this run; both: one engine runs the "
                   "workload without and with drafts in turn for --rounds rounds and reports the speed-up, whether "
                   "the outputs are identical and the drafts proposed and accepted [the config's].")
@click.option("--spec-tokens", type=click.IntRange(min=1, max=64), default=None,
              help="With --speculative on|both: draft tokens per step, K (speculative.num_tokens) [the config's: 4].")
@click.option("--spec-lookup", metavar="MIN:MAX", default=None,
              help="With --speculative on|both: the n-gram lengths looked up (speculative.prompt_lookup_min:max) [the config's: 2:4].")
@click.option("--lora", "lora_adapters", type=click.IntRange(min=1), default=None,
              help="Spread the requests over N random adapters of rank lora.max_lora_rank (all in device slots), "
                   "against the same engine serving the base model alone, in interleaved rounds; reports the cost.")
@click.option("--workload", "workload_kind", type=click.Choice(WORKLOADS), default="random", show_default=True,
              help="random: random token ids; repetitive: prompts asking to copy a 40-line list they hold (the "
                   "output repeats the prompt: speculative decoding's case), lengths set by the text (no --input-len).")
def bench(
    config_path, sets, model, attention, sampler, device, dtype,
    num_seqs, input_len, output_len, seed, temperature, warmup, compare, rounds, peer_pythons, baseline_env, gguf_path,
    hf_batching, hf_batch_size, threads, as_json, url=None, request_rate=float("inf"), max_concurrency=None,
    async_mode=None, spec_mode=None, spec_tokens=None, spec_lookup=None, workload_kind="random", lora_adapters=None,
) -> None:
    """Throughput and latency of corerun on N requests (ignore_eos, exact output lengths): random token
    ids, or with --workload repetitive prompts that ask to copy a list they hold.

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
    spec_sets = _check_speculative(spec_mode, spec_tokens, spec_lookup, async_mode, url, bool(compare or baseline_env))
    _check_workload(workload_kind, input_len, url, bool(compare or baseline_env))
    if lora_adapters is not None and (url is not None or compare or baseline_env or async_mode == "both" or spec_mode == "both"):
        raise click.BadParameter("--lora sets up corerun in this process and compares against its base model; leave out "
                                 "--url, --compare / --baseline-env and the other 'both' modes", param_hint="--lora")
    if async_mode in ("on", "off"):
        sets = (*sets, f"scheduler.async_scheduling={'true' if async_mode == 'on' else 'false'}")
    if spec_mode in ("on", "off"):
        sets = (*sets, *(spec_sets if spec_mode == "on" else ["speculative.method=null"]))
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
        args = (config_path, sets, cfg_args, num_seqs, ranges, seed, temperature, warmup, workload_kind)
        if async_mode == "both":
            doc = _run_async_both(*args, rounds=rounds, quiet=as_json)
        elif spec_mode == "both":
            doc = _run_spec_both(*args, spec_sets=spec_sets, rounds=rounds, quiet=as_json)
        elif lora_adapters is not None:
            doc = _run_lora_both(*args, num_adapters=lora_adapters, rounds=rounds, quiet=as_json)
        else:
            doc = _run(*args)
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
        from corerun.cli.bench_render import render_on_off

        render_on_off(doc)


def _check_speculative(
    spec_mode: str | None, spec_tokens: int | None, spec_lookup: str | None, async_mode: str | None,
    url: str | None, comparing: bool,
) -> list[str]:
    """Usage errors of --speculative and its options; the config settings that switch drafts on."""
    hint = "--speculative"
    if spec_mode is None or spec_mode == "off":
        if spec_tokens is not None or spec_lookup is not None:
            raise click.BadParameter(
                f"--spec-tokens / --spec-lookup set the drafts of speculative decoding; add --speculative on or both"
                + (f" (got --speculative {spec_mode})" if spec_mode else ""), param_hint="--spec-tokens / --spec-lookup")
        if spec_mode is None:
            return []
    if async_mode not in (None, "off") and spec_mode != "off":
        raise click.BadParameter(
            f"--speculative {spec_mode} and --async-scheduling {async_mode} cannot be combined (a run compares one "
            "setting); give one of them, or set the other to off",
            param_hint="--speculative / --async-scheduling")
    if url is not None or (spec_mode == "both" and comparing):
        raise click.BadParameter(
            f"--speculative {spec_mode} sets up corerun in this process"
            + (" or its --compare process; a server started with --url has its own config" if url is not None
               else "; leave out --compare / --baseline-env with both"), param_hint=hint)
    sets = ["speculative.method=ngram"]
    if spec_tokens is not None:
        sets.append(f"speculative.num_tokens={spec_tokens}")
    if spec_lookup is not None:
        from corerun.bench.workload import parse_range

        try:
            lo_hi = parse_range(spec_lookup)
        except ValueError:
            raise click.BadParameter(
                f"got {spec_lookup!r}; give the shortest and longest n-gram looked up as MIN:MAX with "
                "1 <= MIN <= MAX, e.g. 2:4", param_hint="--spec-lookup") from None
        sets += [f"speculative.prompt_lookup_min={lo_hi.lo}", f"speculative.prompt_lookup_max={lo_hi.hi}"]
    return sets


def _check_workload(kind: str, input_len: str | None, url: str | None, comparing: bool) -> None:
    if kind != "repetitive":
        return
    if input_len is not None:
        raise click.BadParameter("the repetitive workload's prompts are the length of their text; leave out "
                                 "--input-len (or use --workload random)", param_hint="--workload / --input-len")
    if url is not None or comparing:
        raise click.BadParameter("--workload repetitive tokenizes its prompts with the engine in this process; "
                                 "leave out --compare / --baseline-env / --url", param_hint="--workload")


def _workload_for(
    cfg: Any, num_seqs: int | None, ranges: list[Any], seed: int, vocab_size: int, max_model_len: int,
    device_type: str, kind: str = "random", tokenizer: Any = None,
) -> Any:
    from corerun.bench.workload import make_repetitive_workload, make_workload

    d_seqs, d_in, d_out = DEFAULTS["cuda" if device_type == "cuda" else "cpu"]
    if kind == "repetitive":
        if tokenizer is None:
            raise click.BadParameter("--workload repetitive needs the model's tokenizer, and this model folder has "
                                     "none (or skip_tokenizer_init is set); use --workload random", param_hint="--workload")
        workload = make_repetitive_workload(num_seqs or d_seqs, ranges[1] or d_out, seed,
                                            lambda text: list(tokenizer.encode(text)))  # as the engine encodes text
    else:
        workload = make_workload(num_seqs or d_seqs, ranges[0] or d_in, ranges[1] or d_out, seed, vocab_size)
    longest = workload.input_len.hi + workload.output_len.hi
    if longest > max_model_len:
        raise click.BadParameter(
            f"input {workload.input_len} + output {workload.output_len} can reach {longest} tokens, but this model's "
            f"max_model_len is {max_model_len}; shorten the ranges",
            param_hint="--input-len / --output-len",
        )
    return workload


def _load(config_path: str | None, sets: tuple[str, ...], cfg_args: dict[str, Any], num_seqs: int | None,
          ranges: list[Any], seed: int, kind: str) -> tuple[Any, Any, float, Any]:
    """Load corerun in this process; the LLM, its memory meter, the load time and the workload."""
    from corerun.bench.corerun_run import load_corerun

    cfg = build_config(config_path, sets, **cfg_args)
    llm, meter, load_s = load_corerun(cfg)
    runner = llm.engine.runner
    workload = _workload_for(cfg, num_seqs, ranges, seed, runner.vocab_size, runner.max_model_len, runner.device.type,
                             kind, llm.engine.tokenizer)
    return llm, meter, load_s, workload


def _run(
    config_path: str | None, sets: tuple[str, ...], cfg_args: dict[str, Any], num_seqs: int | None,
    ranges: list[Any], seed: int, temperature: float, warmup: bool, kind: str = "random",
) -> dict[str, Any]:
    """Load corerun in this process and run the workload; the report document."""
    from corerun.bench.corerun_run import run_corerun
    from corerun.bench.report import build_report

    llm, meter, load_s, workload = _load(config_path, sets, cfg_args, num_seqs, ranges, seed, kind)
    core = run_corerun(llm, workload, meter, load_s, temperature=temperature, warmup=warmup)
    return build_report(workload, core, temperature=temperature, warmup=warmup)


def _progress(quiet: bool, rounds: int, names: dict[str, str]) -> Any:
    def on_run(r: int, mode: str, run: Any, load: float) -> None:
        if not quiet:
            click.echo(f"round {r + 1}/{rounds} {names[mode]}: {run.output_tokens_per_s:.1f} output tok/s (load {load:.2f})", err=True)

    return on_run


def _run_both(
    config_path: str | None, sets: tuple[str, ...], cfg_args: dict[str, Any], num_seqs: int | None,
    ranges: list[Any], seed: int, temperature: float, warmup: bool, kind: str, rounds: int, quiet: bool, *,
    key: str, extra_sets: Sequence[str], switch: Callable[[Any], Callable[[bool], None]], names: tuple[str, str],
    section: Callable[[Any, Any], dict[str, Any]], seed_sampled: bool = False,
    probe: Callable[[Any], Callable[[], Sequence[int]]] | None = None,
) -> dict[str, Any]:
    """One engine, loaded with ``extra_sets``, runs the workload with one setting off and on in turn
    (corerun.bench.on_off): ``switch(engine)`` sets the mode, ``probe(engine)`` reads counters around
    each run, ``names`` label the off and on runs in the progress lines; with ``seed_sampled``, sampled
    requests (temperature > 0) are seeded, so both modes must give the same tokens.  The report of its fastest
    run with the setting on, and ``doc[key] = section(engine, runs)``."""
    from corerun.bench.on_off import run_on_off
    from corerun.bench.report import build_report

    llm, meter, load_s, workload = _load(config_path, (*sets, *extra_sets), cfg_args, num_seqs, ranges, seed, kind)
    try:
        runs = run_on_off(llm, workload, meter, load_s, switch(llm.engine), rounds=rounds, temperature=temperature,
                          warmup=warmup, seeded=seed_sampled and temperature > 0, probe=probe(llm.engine) if probe is not None else None,
                          on_run=_progress(quiet, rounds, dict(zip(("off", "on"), names))))
    finally:
        llm.shutdown()
    doc = build_report(workload, runs.best("on"), temperature=temperature, warmup=warmup)
    doc[key] = section(llm.engine, runs)
    return doc


def _run_async_both(*args: Any, rounds: int, quiet: bool) -> dict[str, Any]:
    """Synchronous and asynchronous scheduling in turn; both modes' throughputs and the speed-up."""
    return _run_both(*args, rounds, quiet, key="async_scheduling",
                     extra_sets=["scheduler.async_scheduling=true"],  # refused where unsupported
                     switch=lambda engine: engine.set_async_scheduling, names=("sync", "async"),
                     section=lambda engine, runs: runs.summary("sync", "async"))


def _run_spec_both(*args: Any, spec_sets: list[str], rounds: int, quiet: bool) -> dict[str, Any]:
    """An engine built with n-gram speculation, drafts off and on in turn (off, its steps are a
    non-speculative engine's); both modes' throughputs, the speed-up and the drafts proposed and
    accepted.  Sampled requests (temperature > 0) are seeded, so both modes must give the same tokens."""

    def probe(engine: Any) -> Callable[[], Sequence[int]]:
        st = engine.spec_stats
        return lambda: (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)

    def section(engine: Any, runs: Any) -> dict[str, Any]:
        spec = engine.config.speculative
        drafts, proposed, accepted = (sum(c[i] for c in runs.counts["on"]) for i in range(3))
        return {
            "method": spec.method, "num_tokens": spec.num_tokens,
            "prompt_lookup_min": spec.prompt_lookup_min, "prompt_lookup_max": spec.prompt_lookup_max,
            **runs.summary("off", "on"),
            # the drafts of every run with speculation on, summed over the rounds, and per round
            "num_drafts": drafts, "proposed": proposed, "accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0,  # tokens per verified row
            "proposed_per_round": [c[1] for c in runs.counts["on"]],
            "accepted_per_round": [c[2] for c in runs.counts["on"]],
        }

    return _run_both(*args, rounds, quiet, key="speculative", extra_sets=spec_sets,
                     switch=lambda engine: engine.set_speculative, names=("speculation off", "speculation on"),
                     section=section, seed_sampled=True, probe=probe)


def _run_lora_both(
    config_path: str | None, sets: tuple[str, ...], cfg_args: dict[str, Any], num_seqs: int | None,
    ranges: list[Any], seed: int, temperature: float, warmup: bool, kind: str, *, num_adapters: int, rounds: int,
    quiet: bool,
) -> dict[str, Any]:
    """The workload over ``num_adapters`` random adapters and on the base alone, in turn (corerun.bench.lora)."""
    import shutil

    from corerun.bench.lora import AdapterRuns, adapters_folder, write_random_adapters
    from corerun.bench.on_off import run_on_off
    from corerun.bench.report import build_report

    extra = ["lora.enabled=true", f"lora.max_loras={num_adapters}"]
    llm, meter, load_s, workload = _load(config_path, (*extra, *sets), cfg_args, num_seqs, ranges, seed, kind)
    folder = adapters_folder()
    try:
        lc = llm.config.lora
        runs_on = AdapterRuns(llm, write_random_adapters(llm.engine, folder, num_adapters, lc.max_lora_rank, seed))
        runs = run_on_off(runs_on, workload, meter, load_s, runs_on.switch, rounds=rounds, temperature=temperature,
                          warmup=warmup, seeded=temperature > 0, on_run=_progress(quiet, rounds, {"off": "base", "on": "lora"}))
    finally:
        llm.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
    doc = build_report(workload, runs.best("on"), temperature=temperature, warmup=warmup)
    doc["lora"] = {"num_adapters": num_adapters, "rank": lc.max_lora_rank, "max_loras": lc.max_loras,
                   "slot_bytes": llm.engine.runner.lora.slot_bytes(), **runs.summary("base", "lora")}
    return doc


def _run_compare(
    config_path: str | None, sets: tuple[str, ...], cfg_args: dict[str, Any], num_seqs: int | None,
    ranges: list[Any], seed: int, temperature: float, warmup: bool, hf_args: dict[str, Any],
    peers: list[str], pythons: dict[str, Any], env: dict[str, str], rounds: int, gguf_path: str | None, quiet: bool,
) -> dict[str, Any]:
    """corerun and ``peers`` in fresh processes, ``rounds`` interleaved rounds; the comparison document."""
    import os
    from pathlib import Path

    from corerun.bench.compare import (BASELINE, PeerError, build_compare_report, build_request, compare, compare_model_dir,
                                       find_python, kv_cache_gib, llamacpp_gguf)
    from corerun.bench.report import base_report
    from corerun.runner.model_runner import resolve_device, resolve_dtype
    from corerun.models.config import ModelConfig
    from corerun.platform.host import resolve_threads

    cfg = build_config(config_path, sets, **cfg_args)
    if resolve_device(cfg.device).type != "cpu":
        raise click.BadParameter("the peers run on CPU (vLLM's CPU build, llama.cpp): use --device cpu", param_hint="--compare")
    model_dir, model_gguf = compare_model_dir(cfg.model)
    mc = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text(encoding="utf-8")))
    max_len = mc.max_model_len if cfg.scheduler.max_model_len == "auto" else cfg.scheduler.max_model_len
    workload = _workload_for(cfg, num_seqs, ranges, seed, mc.vocab_size, max_len, "cpu")
    dtype = str(resolve_dtype(cfg.dtype, resolve_device("cpu"), mc.torch_dtype)).removeprefix("torch.")
    threads = resolve_threads(cfg.threads)
    common = dict(model_dir=str(model_dir), dtype=dtype, threads=threads, temperature=temperature, warmup=warmup,
                  max_model_len=min(max_len, workload.input_len.hi + workload.output_len.hi + 16), vocab_size=mc.vocab_size,
                  kv_cache_gib=kv_cache_gib(workload, mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype))
    gguf = llamacpp_gguf(cfg.model, dtype, Path(gguf_path) if gguf_path else None)
    options = {
        "corerun": {"config_path": config_path, "sets": list(sets), "overrides": {k: v for k, v in cfg_args.items() if v is not None and k not in ("dtype", "threads")},
                    "threads_setting": cfg.threads},  # auto stays auto in corerun's worker (it sizes each step)
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
            if name in ("hf", "vllm") and model_gguf is not None:
                raise PeerError(f"{name} runs a model folder, and corerun's model is the GGUF file {model_gguf}; "
                                "compare it with llama.cpp, or give corerun a folder")
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
