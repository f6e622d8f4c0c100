"""``corerun bench --compare hf,llama.cpp,vllm``: every engine in its own fresh process, interleaved.

Each round runs corerun, then each peer in the order given, every one as a new process
(``PYTHON WORKER.py REQUEST.json RESULT.json``, :mod:`corerun.bench.peers.peer_protocol`) on the same
requests, dtype and thread count; ``rounds`` repeats that (A B C A B C ...), so slow drifts of the
machine's load touch every engine alike.  An engine's summary is its fastest round (as ``timeit``
reports: background load only ever slows a run down); every round's figure and the load average
before it stay in the document.

Peers run in their own virtual environments (``benchmarks/peers/setup.sh``): ``--peer-python
NAME=PATH`` names an interpreter, else ``benchmarks/peers/.venvs/NAME/bin/python`` is used when it
exists (in the working directory, or beside the corerun checkout).  ``hf`` and ``corerun`` run with
this interpreter.  A peer that is not installed, or cannot run this model, is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from corerun.bench.memory import PeakMemory
from corerun.bench.result import RunResult
from corerun.bench.workload import Workload, warmup_prompt
from corerun.errors import CorerunError
from corerun.platform.host import environment_for_others

PEERS = ("hf", "llama.cpp", "vllm")
BASELINE = "corerun-baseline"  # corerun again, with --baseline-env's environment (a before/after in one run)
WORKERS = {
    "corerun": "corerun_worker.py",
    BASELINE: "corerun_worker.py",
    "hf": "hf_worker.py",
    "llama.cpp": "llamacpp_worker.py",
    "vllm": "vllm_worker.py",
}
WORKER_DIR = Path(__file__).parent / "peers"
VENVS = Path("benchmarks") / "peers" / ".venvs"
GGUF_DIR = Path("benchmarks") / "peers" / "models"
GGUF_NAMES = {"float32": "F32", "bfloat16": "BF16"}
WARMUP_TOKENS = 8


class PeerError(CorerunError):
    """A peer could not run (not installed, failed, or produced something unusable)."""


def parse_compare(text: str | None) -> list[str]:
    """``"hf,llama.cpp,vllm"`` -> the peer names in that order (each once); ``None``/``""`` -> []."""
    if not text:
        return []
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip().lower()
        name = {"llamacpp": "llama.cpp", "llama-cpp": "llama.cpp", "transformers": "hf"}.get(name, name)
        if name not in PEERS:
            raise ValueError(f"--compare takes a comma-separated list of {', '.join(PEERS)}; got {raw.strip()!r}")
        if name not in names:
            names.append(name)
    return names


def parse_peer_pythons(items: Sequence[str]) -> dict[str, Path]:
    """``["vllm=/x/bin/python", ...]`` -> {name: path}; names as in :data:`PEERS`."""
    out: dict[str, Path] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not path.strip():
            raise ValueError(f"--peer-python takes NAME=PATH (e.g. vllm=benchmarks/peers/.venvs/vllm/bin/python), got {item!r}")
        peers = parse_compare(name)
        out[peers[0]] = Path(path.strip()).expanduser()
    return out


def search_roots() -> list[Path]:
    """Where ``benchmarks/peers`` is looked for: the working directory, then the corerun checkout."""
    roots = [Path.cwd(), Path(__file__).resolve().parents[2]]
    return list(dict.fromkeys(roots))


def parse_env(items: Sequence[str]) -> dict[str, str]:
    """``["CORERUN_CPU_PREPACK=0", ...]`` -> {name: value} (``--baseline-env``)."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not name.strip().replace("_", "").isalnum():
            raise ValueError(f"--baseline-env takes NAME=VALUE (e.g. CORERUN_CPU_PREPACK=0), got {item!r}")
        out[name.strip()] = value
    return out


def find_python(name: str, given: dict[str, Path]) -> Path:
    """The interpreter that runs peer ``name`` (raises :class:`PeerError` saying how to install it)."""
    if name in given:
        if not given[name].exists():
            raise PeerError(f"--peer-python {name}={given[name]}: no such file")
        return given[name]
    if name in ("corerun", BASELINE, "hf"):
        return Path(sys.executable)
    for root in search_roots():
        python = root / VENVS / name / "bin" / "python"
        if python.exists():
            return python
    return _missing(name)


def _missing(name: str) -> Path:
    raise PeerError(f"{name} is not installed: bash benchmarks/peers/setup.sh creates {VENVS / name}, or pass --peer-python {name}=PATH")


def find_gguf(dtype: str, given: Path | None) -> Path | None:
    """The GGUF file of the default model in ``dtype`` made by ``benchmarks/peers/setup.sh`` (or ``given``)."""
    if given is not None:
        return given
    tag = GGUF_NAMES.get(dtype)
    for root in search_roots():
        path = root / GGUF_DIR / f"SmolLM2-135M-Instruct-{tag}.gguf"
        if tag and path.exists():
            return path
    return None


def compare_model_dir(model: str | None) -> tuple[Path, Path | None]:
    """The model folder every engine reads its config from (corerun's own, ``model_dir_for``: a Hub id's
    snapshot, the folder a ``.gguf`` file converts to, else the default model's float folder), and the
    GGUF file when corerun's ``model`` is one (llama.cpp runs the file itself)."""
    from corerun.config import Config
    from corerun.runner.construction import model_dir_for

    gguf = Path(model) if model and str(model).endswith(".gguf") else None
    return model_dir_for(Config(model=model)), gguf


def llamacpp_gguf(model: str | None, dtype: str, given: Path | None) -> Path | None:
    """The GGUF file llama.cpp runs: ``given`` (``--gguf``); else corerun's ``model`` itself when it is a
    ``.gguf`` file (the very file corerun reads, quantized or not); else, for the default model, the
    unquantized file in ``dtype`` that ``setup.sh`` makes; ``None`` for a model folder."""
    if given is not None:
        return given
    if model and str(model).endswith(".gguf"):
        return Path(model)
    return None if model else find_gguf(dtype, None)


@dataclass
class EngineRuns:
    """Every round of one engine, and why it was skipped (if it was)."""

    name: str
    runs: list[RunResult] = field(default_factory=list)
    loads: list[list[float]] = field(default_factory=list)  # os.getloadavg() before each round
    versions: set[str] = field(default_factory=set)
    skipped: str | None = None

    @property
    def best(self) -> RunResult | None:
        return min(self.runs, key=lambda r: r.elapsed_s) if self.runs else None


def result_from_json(name: str, doc: dict[str, Any], workload: Workload) -> RunResult:
    """A worker's result document -> :class:`RunResult`, checked against the workload it was given."""
    from corerun.bench.peers.peer_protocol import RESULT_KEYS

    missing = [k for k in RESULT_KEYS if k not in doc]
    if missing:
        raise PeerError(f"{name}'s worker wrote a result without {', '.join(missing)}")
    outs = doc["output_token_ids"]
    if len(outs) != workload.num_seqs or [len(o) for o in outs] != list(workload.output_lens):
        raise PeerError(f"{name} did not produce exactly the requested output lengths ({len(outs)} requests returned)")
    elapsed = float(doc["elapsed_s"])
    if not elapsed > 0:
        raise PeerError(f"{name}'s worker reported elapsed_s={doc['elapsed_s']!r}; it must be > 0")
    details = dict(doc["details"])
    details.update(version=doc["version"], threads=doc["threads"])
    return RunResult(
        engine=name,
        elapsed_s=elapsed,
        prompt_tokens=workload.num_prompt_tokens,
        output_tokens=workload.num_output_tokens,
        peak_memory=PeakMemory(int(doc["peak_rss_bytes"]), "peak_rss", False),
        load_s=float(doc["load_s"]),
        ttft_s=[float(x) for x in doc["ttft_s"]],
        tpot_s=[float(x) for x in doc["tpot_s"]],
        details=details,
        output_token_ids=[list(map(int, o)) for o in outs],
    )


def run_worker(
    name: str, python: Path, request: dict[str, Any], workload: Workload, *,
    timeout_s: float, workdir: Path, worker: Path | None = None,
) -> RunResult:
    """One fresh process of engine ``name`` over the workload; its :class:`RunResult`."""
    worker = worker or WORKER_DIR / WORKERS[name]
    stem = name.replace(".", "")
    req_path, out_path, log_path = (workdir / f"{stem}.{ext}" for ext in ("request.json", "result.json", "log"))
    req_path.write_text(json.dumps(request), encoding="utf-8")
    out_path.unlink(missing_ok=True)
    # every engine starts from the user's environment: not the OpenMP policy corerun's import set in this one
    env = dict(environment_for_others(os.environ), **request.get("env", {}), OMP_NUM_THREADS=str(request["threads"]),
               PYTHONUNBUFFERED="1")
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            proc = subprocess.run([str(python), str(worker), str(req_path), str(out_path)], stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise PeerError(f"{name} did not finish within {timeout_s:.0f} s (log: {log_path})") from None
    if proc.returncode != 0 or not out_path.exists():
        tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-15:]
        raise PeerError(f"{name} failed (exit status {proc.returncode}; log {log_path}):\n  " + "\n  ".join(tail))
    try:
        doc = json.loads(out_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise PeerError(f"{name}'s worker wrote an unreadable result: {exc}") from None
    return result_from_json(name, doc, workload)


def kv_cache_gib(workload: Workload, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """GiB of KV cache for every engine that keeps one (vLLM's ``VLLM_CPU_KVCACHE_SPACE``, corerun's
    ``kv_cache.cpu_memory_gb`` where the user sets neither it nor ``kv_cache.num_blocks``): twice what every
    request of the workload holds at once, plus 16k tokens, rounded up, so that no engine preempts and none
    is measured with a cache the others do not get."""
    per_token = 2 * num_layers * num_kv_heads * head_dim * (4 if dtype == "float32" else 2)
    tokens = sum(len(p) for p in workload.prompts) + sum(workload.output_lens) + 16 * 1024
    return max(1, -(-2 * tokens * per_token // 2**30))


def build_request(
    name: str, workload: Workload, *, model_dir: str, dtype: str, threads: int, temperature: float, warmup: bool,
    max_model_len: int, vocab_size: int, gguf: Path | None, options: dict[str, Any], env: dict[str, str] | None = None,
    kv_cache_gib: int | None = None,
) -> dict[str, Any]:
    return {
        "engine": name,
        "model_dir": model_dir,
        "gguf": str(gguf) if gguf else None,
        "dtype": dtype,
        "threads": threads,
        "prompts": workload.prompts,
        "output_lens": workload.output_lens,
        "warmup_prompt": warmup_prompt(workload, vocab_size) if warmup else None,
        "warmup_tokens": WARMUP_TOKENS,
        "temperature": temperature,
        "max_model_len": max_model_len,
        "kv_cache_gib": kv_cache_gib,
        "options": options,
        "env": dict(env or {}),
    }


def compare(
    engines: Sequence[str], requests: dict[str, dict[str, Any]], pythons: dict[str, Path], workload: Workload, *,
    rounds: int = 1, timeout_s: float = 1800.0, on_run: Callable[[str, int, RunResult | None, str | None], None] = lambda *a: None,
    workers: dict[str, Path] | None = None,
) -> dict[str, EngineRuns]:
    """Run ``rounds`` interleaved rounds of ``engines`` (corerun first); a failing peer is dropped with its reason.

    corerun failing is an error (there is nothing to compare against); ``requests[name]`` is the
    request each engine gets, ``pythons[name]`` the interpreter (see :func:`find_python`).
    """
    results = {name: EngineRuns(name) for name in engines}
    with tempfile.TemporaryDirectory(prefix="corerun-bench-") as tmp:
        for r in range(rounds):
            for name in engines:
                er = results[name]
                if er.skipped:
                    continue
                load = list(os.getloadavg())
                try:
                    run = run_worker(name, pythons[name], requests[name], workload, timeout_s=timeout_s,
                                     workdir=Path(tmp), worker=(workers or {}).get(name))
                except PeerError as exc:
                    if name == "corerun":
                        raise
                    er.skipped = str(exc)
                    on_run(name, r, None, er.skipped)
                    continue
                er.runs.append(run)
                er.loads.append(load)
                er.versions.add(str(run.details.get("version")))
                on_run(name, r, run, None)
    return results


def build_compare_report(results: dict[str, EngineRuns], base: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: ``base`` (version, machine, workload) plus ``engines``, ``ratio`` and ``skipped``."""
    from corerun.bench.report import same_outputs

    core = results["corerun"].best
    assert core is not None
    engines: dict[str, Any] = {}
    ratio: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for name, er in results.items():
        best = er.best
        if best is None:
            skipped[name] = er.skipped or "no run finished"
            continue
        d = best.to_dict()
        d["ms_per_output_token"] = best.elapsed_s * 1e3 / best.output_tokens
        d["rounds"] = [
            {"output_tokens_per_s": run.output_tokens_per_s, "elapsed_s": run.elapsed_s, "loadavg_before": load}
            for run, load in zip(er.runs, er.loads)
        ]
        if name != "corerun":
            d["same_outputs_as_corerun"] = same_outputs(core.output_token_ids, best.output_token_ids)
            ratio[name] = _ratios(core, best)
        if er.skipped:
            d["failed_later_round"] = er.skipped
        engines[name] = d
    return {**base, "engines": engines, "ratio": ratio, "skipped": skipped}


def _ratios(core: RunResult, peer: RunResult) -> dict[str, float | None]:
    """corerun / peer for throughput (> 1: corerun faster); corerun / peer for latencies (< 1: corerun faster)."""
    from corerun.bench.stats import summarize

    def med(xs: list[float]) -> float | None:
        return summarize(xs)["median"]

    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    return {
        "output_tokens_per_s": core.output_tokens_per_s / peer.output_tokens_per_s,
        "total_tokens_per_s": core.total_tokens_per_s / peer.total_tokens_per_s,
        "ms_per_output_token": peer.output_tokens_per_s / core.output_tokens_per_s,
        "ttft_median": div(med(core.ttft_s), med(peer.ttft_s)),
        "tpot_median": div(med(core.tpot_s), med(peer.tpot_s)),
    }


def render_compare(doc: dict[str, Any], console: Any = None) -> None:
    """One row per engine: throughput, latencies, the ratios against corerun, same outputs, threads and load."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=max(Console().width, 120))
    w = doc["workload"]
    table = Table(
        title=(
            f"corerun bench --compare: {w['num_seqs']} seqs, input {w['input_len'][0]}-{w['input_len'][1]}, "
            f"output {w['output_len'][0]}-{w['output_len'][1]}, seed {w['seed']}, {doc['dtype']}, "
            f"{doc['threads']} thread(s), best of {doc['rounds']} round(s)"
        )
    )
    for col in ("engine", "output tok/s", "ms / output tok", "TTFT med (ms)", "TPOT med (ms)", "corerun / peer (tok/s)",
                "same outputs", "load before"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for name, e in doc["engines"].items():
        r = doc["ratio"].get(name)
        table.add_row(
            name, f"{e['output_tokens_per_s']:.1f}", f"{e['ms_per_output_token']:.1f}",
            _fmt(e["ttft_ms"]["median"]), _fmt(e["tpot_ms"]["median"]),
            f"{r['output_tokens_per_s']:.2f}x" if r else "",
            f"{e['same_outputs_as_corerun']}/{w['num_seqs']}" if "same_outputs_as_corerun" in e else "",
            " / ".join(f"{rd['loadavg_before'][0]:.2f}" for rd in e["rounds"]),
        )
    console.print(table)
    for name, e in doc["engines"].items():
        rounds = ", ".join(f"{rd['output_tokens_per_s']:.1f}" for rd in e["rounds"])
        console.print(f"{name} {e.get('version', '')}: {e.get('threads', '?')} thread(s); output tok/s per round {rounds}")
    for name, why in doc["skipped"].items():
        console.print(f"[yellow]{name} skipped[/yellow]: {why}")
    console.print(f"load average (1, 5, 15 min) at the end: {', '.join(f'{x:.2f}' for x in doc['loadavg_after'])}")


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"
