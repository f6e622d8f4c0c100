"""The benchmark's results as one JSON document and as a rich table.

JSON keys (``corerun bench --json``): ``corerun_version``, ``machine`` (platform, python, torch,
cpu_count, physical_cores, native_bfloat16, torch_threads, loadavg, gpu), ``workload`` (kind, num_seqs,
input_len, output_len, seed, prompt_tokens, output_tokens, temperature, warmup) and ``corerun`` (elapsed_s,
load_s, prompt_tokens, output_tokens, output_tokens_per_s, total_tokens_per_s, ttft_ms and tpot_ms
as {median, p90, p99}, peak_memory {bytes, kind, reset}, backends, model).  ``--async-scheduling both``
adds ``async_scheduling`` and ``--speculative both`` adds ``speculative`` (corerun.cli.bench: per-round
tokens/s of each mode, speedup, same_outputs; for speculation also the drafts proposed and accepted).
With ``--compare`` the document is :func:`corerun.bench.compare.build_compare_report`'s instead.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from corerun._version import __version__
from corerun.bench.result import RunResult
from corerun.bench.workload import Workload
from corerun.platform.host import native_bfloat16, physical_cores


def same_outputs(a: list[list[int]], b: list[list[int]]) -> int:
    """How many requests got exactly the same output token ids from both runs."""
    return sum(1 for x, y in zip(a, b) if x == y)


def base_report(workload: Workload, *, temperature: float, warmup: bool) -> dict[str, Any]:
    """What every report starts with: the version, the machine (threads, load) and the workload."""
    return {
        "corerun_version": __version__,
        "machine": machine_info(),
        "workload": {**workload.describe(), "temperature": temperature, "warmup": warmup},
    }


def build_report(workload: Workload, core: RunResult, *, temperature: float, warmup: bool) -> dict[str, Any]:
    return {**base_report(workload, temperature=temperature, warmup=warmup), "corerun": core.to_dict()}


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "physical_cores": physical_cores(),
        "native_bfloat16": native_bfloat16(),
        "torch_threads": torch.get_num_threads(),
        "loadavg": list(os.getloadavg()),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def render(doc: dict[str, Any], console: Any = None) -> None:
    """Print ``doc`` (corerun alone) as a rich table."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    core = doc["corerun"]
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

    def row(label: str, key: str, fmt: str) -> None:
        table.add_row(label, _fmt(_get(core, key), fmt))

    row("output tokens/s", "output_tokens_per_s", ".1f")
    row("total tokens/s", "total_tokens_per_s", ".1f")
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
        f"corerun backends: attention={b['attention']} fused_ops={b.get('fused_ops', '-')} kv_cache={b['kv_cache']} "
        f"graph={b['graph']} sampler={b['sampler']} on {b['device']}/{b['dtype']}; model {core['model']}"
    )
    m = doc["machine"]
    console.print(f"threads: {m['torch_threads']} (physical cores {m['physical_cores']}); load average "
                  f"{', '.join(f'{x:.2f}' for x in m['loadavg'])} (1, 5, 15 min)")
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
