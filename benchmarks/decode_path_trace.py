"""Trace one decode step with ``sys.settrace`` and count the code on its path.

    .venv/bin/python benchmarks/decode_path_trace.py [--attention cpu] [--sampler full] [--warmup 2] [--json]

One greedy request (random prompt ids) on the tiny random Llama of ``corerun.testing.tiny_models``
(CPU, float32, ``graph.runner: eager``); the prefill and ``--warmup`` decode steps run untraced, then
one ``LLMEngine.step`` that decodes one token is traced.  Every call into ``corerun/`` or
``plugins/`` is recorded (a lambda or comprehension counts as the function around it); torch and the
standard library are not.  Per file it prints the functions entered, their lines of code (each
function's ``def`` to its end, without its docstring, comments and blank lines) and the lines of
them executed; then the totals and the moves between files (how often the traced line changed file).
``--json`` prints the same as one JSON object: ``files`` (path -> ``functions``, ``lines``,
``executed``, ``names``) and ``totals`` (``files``, ``functions``, ``lines``, ``executed``, ``moves``).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACED = (str(ROOT / "corerun") + "/", str(ROOT / "plugins") + "/")


@lru_cache(maxsize=None)
def functions_of(path: str) -> list[tuple[int, int, str, frozenset[int]]]:
    """Every function in ``path``: (first line, last line, qualified name, its lines of code)."""
    source = Path(path).read_text()
    lines = source.splitlines()
    out: list[tuple[int, int, str, frozenset[int]]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                skip: set[int] = set()
                body = child.body
                if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                        and isinstance(body[0].value.value, str):
                    skip.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
                end = child.end_lineno or child.lineno
                code = frozenset(
                    n for n in range(child.lineno, end + 1)
                    if n not in skip and lines[n - 1].strip() and not lines[n - 1].strip().startswith("#")
                )
                out.append((child.lineno, end, name, code))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def enclosing(path: str, line: int) -> tuple[int, int, str, frozenset[int]] | None:
    """The innermost function of ``path`` holding ``line`` (None at module or class level)."""
    best = None
    for f in functions_of(path):
        if f[0] <= line <= f[1] and (best is None or f[0] >= best[0]):
            best = f
    return best


class PathTrace:
    """Collects the (file, line) events of the traced code, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def _local(self, frame, event, arg):  # noqa: ANN001
        if event == "line":
            self.events.append((frame.f_code.co_filename, frame.f_lineno))
        return self._local

    def __call__(self, frame, event, arg):  # noqa: ANN001
        path = frame.f_code.co_filename
        if event != "call" or not path.startswith(TRACED):
            return None
        self.events.append((path, frame.f_code.co_firstlineno))
        return self._local

    def report(self) -> dict:
        files: dict[str, dict] = {}
        moves, last = 0, None
        for path, line in self.events:
            if last is not None and path != last:
                moves += 1
            last = path
            f = enclosing(path, line)
            if f is None:
                continue
            entry = files.setdefault(path, {"functions": {}, "executed": set()})
            entry["functions"][f[2]] = f[3]
            if line in f[3]:
                entry["executed"].add(line)
        out = {}
        for path, entry in sorted(files.items()):
            code = frozenset().union(*entry["functions"].values())
            out[str(Path(path).relative_to(ROOT))] = {
                "functions": len(entry["functions"]), "lines": len(code),
                "executed": len(entry["executed"] & code), "names": sorted(entry["functions"]),
            }
        totals = {
            "files": len(out), "functions": sum(v["functions"] for v in out.values()),
            "lines": sum(v["lines"] for v in out.values()), "executed": sum(v["executed"] for v in out.values()),
            "moves": moves,
        }
        return {"files": out, "totals": totals}


def trace_decode_step(attention: str = "cpu", sampler: str = "full", warmup: int = 2, seed: int = 0) -> dict:
    """Build the engine, run the prefill and ``warmup`` decodes, trace one decode step; the report."""
    import corerun  # noqa: F401  (before torch: its OpenMP settings, corerun.platform.host)
    import torch

    from corerun.sampling_params import SamplingParams
    from corerun.testing.engines import make_llm
    from corerun.testing.tiny_models import make_tiny_model

    torch.manual_seed(seed)
    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="corerun-trace-")), arch="llama")
    llm = make_llm(model, attention=attention, sampler=sampler, graph={"runner": "eager"})
    try:
        engine = llm.engine
        rng = random.Random(seed)
        engine.add_request([rng.randrange(1, 200) for _ in range(12)], SamplingParams(temperature=0.0, max_tokens=warmup + 8, ignore_eos=True))
        while engine.scheduler.num_generated_tokens < 1:  # the prefill (and its first token)
            engine.step()
        for _ in range(warmup):
            engine.step()
        tracer = PathTrace()
        sys.settrace(tracer)
        try:
            touched = engine.step()
        finally:
            sys.settrace(None)
        if len(touched) != 1:
            raise RuntimeError(f"the traced step touched {len(touched)} requests; expected the one decode")
        return tracer.report()
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attention", default="cpu", help="attention backend (default cpu; torch without corerun-attention-cpu)")
    parser.add_argument("--sampler", default="full")
    parser.add_argument("--warmup", type=int, default=2, help="decode steps run untraced before the traced one")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    report = trace_decode_step(args.attention, args.sampler, args.warmup)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{'file':<60} {'functions':>9} {'lines':>6} {'executed':>8}")
    for path, v in report["files"].items():
        print(f"{path:<60} {v['functions']:>9} {v['lines']:>6} {v['executed']:>8}")
    t = report["totals"]
    print(f"total: {t['files']} files, {t['functions']} functions, {t['lines']} lines ({t['executed']} executed), "
          f"{t['moves']} moves between files")


if __name__ == "__main__":
    main()
