"""One engine, one setting switched off and on: ``corerun bench --async-scheduling both`` and
``--speculative both``.

Each mode is warmed up once and the workload's prompts are computed once (one token each), so
every measured run finds the same prompt blocks in the prefix cache (without that, only the first
run would compute its prompts in full); then every round runs the workload in both modes, the order
alternating (off, on; on, off; ...) so a drift of the machine's load falls on both.  The summary
gives each mode's output tokens/s per round, the ratio of the fastest of each (``speedup``: on over
off) and per round, and how many requests got the same tokens in both modes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from corerun.bench.corerun_run import run_corerun, warm_up
from corerun.bench.memory import PeakMemoryMeter
from corerun.bench.report import same_outputs
from corerun.bench.result import RunResult
from corerun.bench.workload import Workload

MODES = ("off", "on")


@dataclass
class OnOffRuns:
    """Every measured run of each mode, in round order, the 1-minute load average before each run and,
    with a ``probe``, what its counters grew by during each run."""

    runs: dict[str, list[RunResult]] = field(default_factory=lambda: {m: [] for m in MODES})
    loads: list[float] = field(default_factory=list)
    counts: dict[str, list[list[int]]] = field(default_factory=lambda: {m: [] for m in MODES})

    def best(self, mode: str) -> RunResult:
        return max(self.runs[mode], key=lambda r: r.output_tokens_per_s)

    def summary(self, off_name: str, on_name: str) -> dict[str, Any]:
        """``{off_name}_output_tokens_per_s`` and ``{on_name}_...`` (per round), speedup (fastest on /
        fastest off), speedup_per_round, same_outputs (of the fastest runs), loadavg_before_runs."""
        tps = {m: [r.output_tokens_per_s for r in self.runs[m]] for m in MODES}
        return {
            "rounds": len(tps["on"]),
            f"{off_name}_output_tokens_per_s": tps["off"],
            f"{on_name}_output_tokens_per_s": tps["on"],
            "speedup": self.best("on").output_tokens_per_s / self.best("off").output_tokens_per_s,
            "speedup_per_round": [a / b for a, b in zip(tps["on"], tps["off"])],
            "same_outputs": same_outputs(self.best("on").output_token_ids, self.best("off").output_token_ids),
            "loadavg_before_runs": self.loads,
        }


def run_on_off(
    llm: Any, workload: Workload, meter: PeakMemoryMeter, load_s: float, switch: Callable[[bool], None], *,
    rounds: int, temperature: float, warmup: bool, seeded: bool = False,
    probe: Callable[[], Sequence[int]] | None = None, on_run: Callable[[int, str, RunResult, float], None] | None = None,
) -> OnOffRuns:
    """Run ``workload`` ``rounds`` times in each mode on ``llm``, ``switch(on)`` setting the mode.

    ``probe()``: counters read before and after each measured run (the engine's speculative
    decoding statistics), their growth kept in ``counts``; ``on_run(round, mode, run, load)`` is
    called after each run (progress lines).
    """
    if warmup:
        for mode in MODES:
            switch(mode == "on")
            warm_up(llm, workload, temperature)
    from corerun.sampling_params import SamplingParams

    llm.generate(workload.prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    out = OnOffRuns()
    for r in range(rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            switch(mode == "on")
            out.loads.append(os.getloadavg()[0])
            before = list(probe()) if probe is not None else []
            run = run_corerun(llm, workload, meter, load_s, temperature=temperature, warmup=False, seeded=seeded)
            out.runs[mode].append(run)
            if probe is not None:
                out.counts[mode].append([a - b for a, b in zip(probe(), before)])
            if on_run is not None:
                on_run(r, mode, run, out.loads[-1])
    return out
