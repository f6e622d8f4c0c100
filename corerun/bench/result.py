"""What one engine's run of the workload measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from corerun.bench.memory import PeakMemory
from corerun.bench.stats import summarize


@dataclass
class RunResult:
    """One engine, one pass over the workload (after its warm-up).

    ``elapsed_s`` is the wall time of the measured pass; the token counts are the workload's (prompt
    tokens read, output tokens asked for and produced); ``ttft_s`` / ``tpot_s`` are per request, empty
    when the engine cannot time requests one by one.
    """

    engine: str
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    peak_memory: PeakMemory
    load_s: float
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)  # backends, batching mode, ...
    output_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        ms = lambda s: {k: (None if v is None else v * 1e3) for k, v in summarize(s).items()}  # noqa: E731
        return {
            "elapsed_s": self.elapsed_s,
            "load_s": self.load_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "ttft_ms": ms(self.ttft_s),
            "tpot_ms": ms(self.tpot_s),
            "peak_memory": self.peak_memory.to_dict(),
            **self.details,
        }
