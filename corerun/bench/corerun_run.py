"""Run the workload through corerun's offline API (``LLM.generate``), after one warm-up request."""

from __future__ import annotations

import time
from typing import Any

import torch

from corerun.bench.memory import PeakMemoryMeter
from corerun.bench.result import RunResult
from corerun.bench.stats import request_latencies
from corerun.bench.workload import Workload, warmup_prompt
from corerun.errors import CorerunError

WARMUP_TOKENS = 8


def load_corerun(config: Any) -> tuple[Any, PeakMemoryMeter, float]:
    """Build ``LLM(config=config)``; returns it, a memory meter started before the load, and the load time (s)."""
    from corerun.llm import LLM
    from corerun.runner.model_runner import resolve_device

    meter = PeakMemoryMeter(resolve_device(config.device))
    meter.start()
    t0 = time.perf_counter()
    llm = LLM(config=config)
    return llm, meter, time.perf_counter() - t0


def warm_up(llm: Any, workload: Workload, temperature: float = 0.0) -> None:
    """One short request apart from the workload (:func:`warmup_prompt`), before a measured run."""
    from corerun.sampling_params import SamplingParams

    prompt = warmup_prompt(workload, llm.engine.runner.vocab_size)
    llm.generate([prompt], SamplingParams(temperature=temperature, max_tokens=WARMUP_TOKENS, ignore_eos=True), use_tqdm=False)


def run_corerun(
    llm: Any, workload: Workload, meter: PeakMemoryMeter, load_s: float, *, temperature: float = 0.0,
    warmup: bool = True, seeded: bool = False,
) -> RunResult:
    """Time one ``llm.generate`` over the whole workload (``ignore_eos``, exact output lengths).

    ``seeded``: request ``i`` samples with seed ``workload.seed + i``, so two runs of a sampled
    workload can be compared token for token (``--speculative both``).
    """
    from corerun.sampling_params import SamplingParams

    runner = llm.engine.runner
    if warmup:
        warm_up(llm, workload, temperature)
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True,
                             seed=workload.seed + i if seeded else None) for i, n in enumerate(workload.output_lens)]
    _sync(runner.device)
    t0 = time.perf_counter()
    outs = llm.generate(workload.prompts, params, use_tqdm=False)
    _sync(runner.device)
    elapsed = time.perf_counter() - t0
    failed = [(i, o.outputs[0].finish_reason, o.outputs[0].error) for i, o in enumerate(outs) if o.outputs[0].finish_reason != "length"]
    if failed:
        i, reason, error = failed[0]
        raise CorerunError(
            f"{len(failed)} of {len(outs)} benchmark requests did not run to their length; request {i} ended with "
            f"finish_reason={reason!r}" + (f": {error}" if error else "")
        )
    n_out = [len(o.outputs[0].token_ids) for o in outs]
    ttft, tpot = request_latencies([o.metrics for o in outs], n_out)
    return RunResult(
        engine="corerun",
        elapsed_s=elapsed,
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
        output_tokens=sum(n_out),
        peak_memory=meter.read(runner.step_memory.high_water_bytes if runner.step_memory else 0),
        load_s=load_s,
        ttft_s=ttft,
        tpot_s=tpot,
        details={"backends": runner.describe(), "model": str(runner.model_dir)},
        output_token_ids=[list(o.outputs[0].token_ids) for o in outs],
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
