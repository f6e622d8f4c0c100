"""The benchmark's results as one JSON document and as a rich table.

JSON keys (``corerun bench --json``): ``corerun_version``, ``machine`` (platform, python, torch,
cpu_count, torch_threads, gpu), ``workload`` (num_seqs, input_len, output_len, seed, prompt_tokens, output_tokens,
temperature, warmup), ``corerun`` (elapsed_s, load_s, prompt_tokens, output_tokens,
output_tokens_per_s, total_tokens_per_s, ttft_ms and tpot_ms as {median, p90, p99}, peak_memory
{bytes, kind, reset}, backends, model), ``hf`` (the same keys, ttft/tpot null, plus batching,
batch_size, generated_tokens, attn_implementation, same_outputs_as_corerun; null without
``--compare hf``) and ``ratio`` (corerun / hf for output_tokens_per_s and total_tokens_per_s; null
without a comparison).
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from corerun._version import __version__
from corerun.bench.result import RunResult
from corerun.bench.workload import Workload


def same_outputs(a: list[list[int]], b: list[list[int]]) -> int:
    """How many requests got exactly the same output token ids from both runs."""
    return sum(1 for x, y in zip(a, b) if x == y)


def build_report(workload: Workload, core: RunResult, hf: RunResult | None, *, temperature: float, warmup: bool) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "corerun_version": __version__,
        "machine": machine_info(),
        "workload": {**workload.describe(), "temperature": temperature, "warmup": warmup},
        "corerun": core.to_dict(),
        "hf": None,
        "ratio": None,
    }
    if hf is not None:
        doc["hf"] = {**hf.to_dict(), "same_outputs_as_corerun": same_outputs(core.output_token_ids, hf.output_token_ids)}
        doc["ratio"] = {
            "output_tokens_per_s": core.output_tokens_per_s / hf.output_tokens_per_s,
            "total_tokens_per_s": core.total_tokens_per_s / hf.total_tokens_per_s,
        }
    return doc


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def render(doc: dict[str, Any], console: Any = None) -> None:
    """Print ``doc`` as a rich table (corerun, HF when compared, and their ratio)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    core, hf = doc["corerun"], doc["hf"]
    w = doc["workload"]
    table = Table(
        title=(
            f"corerun bench: {w['num_seqs']} seqs, input {w['input_len'][0]}-{w['input_len'][1]}, "
            f"output {w['output_len'][0]}-{w['output_len'][1]}, seed {w['seed']} "
            f"({w['prompt_tokens']} prompt + {w['output_tokens']} output tokens)"
        )
    )
    table.add_column("metric")
    table.add_column("corerun", justify="right")
    if hf is not None:
        table.add_column(f"HF generate ({hf['batching']}, batch {hf['batch_size']})", justify="right")
        table.add_column("corerun / HF", justify="right")

    def row(label: str, key: str, fmt: str, ratio: bool = False) -> None:
        cells = [label, _fmt(_get(core, key), fmt)]
        if hf is not None:
            a, b = _get(core, key), _get(hf, key)
            cells += [_fmt(b, fmt), f"{a / b:.2f}x" if ratio and a and b else ""]
        table.add_row(*cells)

    row("output tokens/s", "output_tokens_per_s", ".1f", ratio=True)
    row("total tokens/s", "total_tokens_per_s", ".1f", ratio=True)
    row("elapsed (s)", "elapsed_s", ".2f")
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms")):
        for q in ("median", "p90", "p99"):
            row(f"{name} {q} (ms)", f"{key}.{q}", ".1f")
    mem_label = "peak CUDA memory (MiB)" if core["peak_memory"]["kind"].startswith("cuda") else "peak RSS (MiB)"
    row(mem_label, "peak_memory.mib", ".0f")
    row("load (s)", "load_s", ".2f")
    console.print(table)
    b = core["backends"]
    console.print(
        f"corerun backends: attention={b['attention']} kv_cache={b['kv_cache']} graph={b['graph']} "
        f"sampler={b['sampler']} on {b['device']}/{b['dtype']}; model {core['model']}"
    )
    if hf is not None:
        console.print(
            f"HF: attn_implementation={hf['attn_implementation']}, {hf['generated_tokens']} tokens generated for "
            f"{hf['output_tokens']} asked; same output tokens as corerun for {hf['same_outputs_as_corerun']} of {w['num_seqs']} requests"
        )
    if not core["peak_memory"]["reset"]:
        console.print("note: the peak RSS could not be reset; it covers the whole process up to this point")


def _get(d: dict[str, Any], key: str) -> float | None:
    if key == "peak_memory.mib":
        return d["peak_memory"]["bytes"] / 2**20
    for part in key.split("."):
        d = d.get(part) if isinstance(d, dict) else None  # type: ignore[assignment]
    return d  # type: ignore[return-value]


def _fmt(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)
