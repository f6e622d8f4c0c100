"""The conformance suites of one ``run.sh`` part on CUDA, one results file written case by case.

``corerun conformance --json`` prints its document only at the end, so a suite stopped by its time
limit would leave nothing; this driver runs the same suites, configured as that command configures
them (``--device cuda``, ``--option``, ``-k``, ``--attention``), through the same pytest invocation
(:func:`corerun.conformance.runner.invoke`), and rewrites ``--out`` before and after every case:
``running`` names the case a killed part was in.  A :class:`Tests` entry runs repository tests as
they are (``pytest NODEID``), reported the same way, for a kernel no registered suite reaches on CUDA.

    python benchmarks/gpu/conformance_part.py --group triton --out RESULTS/conformance-triton.json

Exit status 1 when a case failed (failed, error, xpassed), a suite or tests entry that must run here is
unavailable, or one ran nothing; ``attention:flash`` is optional (flash-attn is rarely installed).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu.part_report import PartReport  # noqa: E402


@dataclass(frozen=True)
class Suite:
    """One ``corerun conformance`` invocation: ``impl`` (KIND:NAME) and its options."""

    impl: str
    options: dict[str, Any] = field(default_factory=dict)
    keyword: str | None = None
    attention: str | None = None  # graph runners: the backend the suite's model attends with
    optional: bool = False  # unavailable here is not a failure

    @property
    def label(self) -> str:
        extra = [f"{k}={v}" for k, v in self.options.items()]
        if self.attention:
            extra.append(f"attention={self.attention}")
        if self.keyword:
            extra.append(f"-k {self.keyword!r}")
        return " ".join([self.impl, *extra])


@dataclass(frozen=True)
class Tests:
    """Repository tests run as they are, ``pytest NODEID`` (from the repository root), compiled on CUDA:
    for the mixture-of-experts experts kernel, a model layer's, which the model suite never reaches
    (its float64 references keep the layer off Triton)."""

    nodeid: str
    optional: bool = False

    @property
    def label(self) -> str:
        return f"pytest {self.nodeid}"


MOE_TRITON = Tests("tests/test_models_moe_triton.py::test_triton_experts_equal_a_dense_per_expert_reference")
INT_GEMM_TRITON = Tests("tests/test_quantization_int_gemm_triton.py")  # W4A16 / W8A16: the kernel and the methods, about 24 compiles

# Most important first inside each group: a part cut short keeps what ran.
GROUPS: dict[str, list[Suite | Tests]] = {
    "graph": [Suite("graph:cuda"), Suite("graph:cuda", attention="triton")],
    "triton": [Suite("attention:triton"), Suite("attention:triton", options={"num_splits": 4}, keyword="decode or mixed"),
               Suite("lora:triton"), MOE_TRITON, INT_GEMM_TRITON],
    "rest": [Suite("attention:torch"), Suite("sampler:full"), Suite("sampler:basic"), Suite("lora:torch"),
             Suite("lora:grouped"), Suite("attention:flash", optional=True)],
}


def pytest_args(suite: Suite, device: str) -> list[str]:
    """The pytest command line ``corerun conformance`` builds for ``suite``."""
    from corerun.conformance.runner import pytest_args as args_for

    return args_for(suite.impl, keyword=suite.keyword, device=device, attention=suite.attention,
                    options=[f"{k}={v}" for k, v in suite.options.items()])


def cases(suite: Suite, device: str) -> tuple[Any, Any, list[Any]]:
    """(the collector, the target, the cases pytest selects), in the order they run."""
    from corerun.conformance.runner import ResultCollector, invoke
    from corerun.conformance.settings import parse_impl
    from corerun.conformance.target import Target

    kind, name = parse_impl(suite.impl)
    target = Target.registered(kind, name, suite.options)
    collector = ResultCollector(suite.impl)
    invoke(pytest_args(suite, device), collector, collect_only=True)
    return collector, target, [c for c in collector.cases.values() if c is not None]


def tests_args(tests: Tests) -> list[str]:
    """The pytest command line for ``tests``: the repository's settings and conftest, no terminal output."""
    return ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), "-p", "no:cacheprovider", "-p", "no:terminal",
            str(ROOT / tests.nodeid)]


def tests_unavailable(device: str) -> list[str]:
    """Why tests that must run compiled on CUDA cannot here: the Triton interpreter is no check of that."""
    if device != "cuda":
        return []
    import torch

    reasons = []
    if not torch.cuda.is_available():
        reasons.append("no CUDA device (torch.cuda.is_available() is False): the Triton kernels would be interpreted")
    interpret = os.environ.get("TRITON_INTERPRET", "0")
    if interpret not in ("", "0"):
        reasons.append(f"TRITON_INTERPRET={interpret}: the Triton kernels would be interpreted; unset it")
    return reasons


def _pytest(args: list[str], plugins: list[Any]) -> None:
    import pytest

    code = pytest.main(args, plugins=plugins)
    if code in (pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.INTERNAL_ERROR):
        raise RuntimeError(f"pytest exit status {int(code)} for: pytest {shlex.join(args)}")


class _Collected:
    """The ids of the tests pytest selects, and the first collection error."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.error: str | None = None

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed and self.error is None:
            self.error = f"{report.nodeid or 'collection'}: {_failure(report.longreprtext)}"

    def pytest_collection_finish(self, session: Any) -> None:
        self.ids = [item.nodeid for item in session.items]


def node_ids(tests: Tests) -> list[str]:
    """The test ids ``tests`` selects, in the order they run; a collection error raises RuntimeError."""
    collected = _Collected()
    _pytest([*tests_args(tests), "--collect-only"], [collected])
    if collected.error:
        raise RuntimeError(collected.error)
    return collected.ids


def _failure(text: str) -> str:
    """pytest's ``E`` lines of a failure (the assertion and its message), else its last line."""
    lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    return " ".join(lines)[:2000] if lines else (text.strip().splitlines() or [""])[-1]


@dataclass
class _Row:
    nodeid: str
    outcome: str
    reason: str = ""


class _Outcomes:
    """One row per test, outcomes named as the suites' (passed, failed, error, skipped, xfailed, xpassed),
    handed to ``progress`` once its teardown reported: a failing setup or teardown makes it an error."""

    def __init__(self, progress: Any) -> None:
        self.progress, self.rows = progress, {}

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.progress(_Row(report.nodeid or "collection", "error", _failure(report.longreprtext)))

    def pytest_runtest_logreport(self, report: Any) -> None:
        row = self.rows.setdefault(report.nodeid, _Row(report.nodeid, ""))
        if report.passed and report.when == "call":
            expected = getattr(report, "wasxfail", None)
            row.outcome, row.reason = ("xpassed", f"expected to fail ({expected}) but passed") if expected is not None else ("passed", "")
        elif report.skipped and not row.outcome:
            expected = getattr(report, "wasxfail", None)
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            row.outcome, row.reason = ("xfailed", expected) if expected is not None else ("skipped", reason)
        elif report.failed and row.outcome in ("", "passed"):
            row.outcome = "failed" if report.when == "call" else "error"
            row.reason = f"{report.when}: {_failure(report.longreprtext)}"
        if report.when == "teardown":
            self.progress(self.rows.pop(report.nodeid))


class _CaseByCase:
    """Hooks that open a check of ``report`` when a case starts and close it with the case's result."""

    def __init__(self, report: PartReport, counts: dict[str, int]) -> None:
        self.report, self.counts, self.names = report, counts, {}
        self.open: Any = None

    def pytest_collection_finish(self, session: Any) -> None:
        for item in session.items:
            case = getattr(item, "callspec", None) and item.callspec.params.get("case")
            self.names[item.nodeid] = case.full_id if case is not None else item.nodeid

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.open = self.report.check(self.names.get(nodeid, nodeid))
        self.entry = self.open.__enter__()

    def result(self, result: Any) -> None:
        from corerun.conformance.runner import FAILING

        if self.open is None:  # a collection error: no case was open
            self.open = self.report.check(result.nodeid)
            self.entry = self.open.__enter__()
        self.entry.update(outcome=result.outcome, reason=result.reason, ok=result.outcome not in FAILING)
        self.counts[result.outcome] = self.counts.get(result.outcome, 0) + 1
        self.open.__exit__(None, None, None)
        self.open = None


def run_suite(report: PartReport, suite: Suite | Tests, device: str) -> bool:
    from corerun.conformance.runner import FAILING, ResultCollector, invoke

    entry: dict[str, Any] = {"suite": suite.label}
    report.results[suite.label] = entry
    with report.check(f"{suite.label}: enumerate the cases", catch=True) as step:
        if isinstance(suite, Tests):
            entry["unavailable_reasons"] = tests_unavailable(device)
            entry["planned"] = len(node_ids(suite))
            entry["pytest"] = "pytest " + shlex.join(tests_args(suite))
        else:
            _, target, selected = cases(suite, device)
            entry["implementation"] = target.label
            entry["unavailable_reasons"] = target.unavailable_reasons()
            entry["planned"] = len(selected)
            entry["pytest"] = "pytest " + shlex.join(pytest_args(suite, device))
        if entry["unavailable_reasons"] and not suite.optional:
            step.update(ok=False, error="unavailable here: " + "; ".join(entry["unavailable_reasons"]))
    if step["ok"] is False:
        return False
    if entry["unavailable_reasons"]:
        entry["skipped_because"] = "optional and unavailable here"
        report.save()
        return True
    counts: dict[str, int] = {}
    entry["summary"] = counts
    per_case = _CaseByCase(report, counts)
    if isinstance(suite, Tests):
        _pytest(tests_args(suite), [per_case, _Outcomes(per_case.result)])
    else:
        invoke(pytest_args(suite, device), ResultCollector(suite.impl, progress=per_case.result), plugins=[per_case])
    ran = counts.get("passed", 0) + counts.get("xfailed", 0)
    failed = sum(counts.get(o, 0) for o in FAILING)
    entry["ok"] = failed == 0 and ran > 0
    if ran == 0:
        entry["error"] = "nothing ran: every case was skipped"
    report.save()
    return entry["ok"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group", required=True, choices=sorted(GROUPS))
    p.add_argument("--out", type=Path, required=True, help="results file (JSON)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dry-run", action="store_true", help="write the results file with the planned suites, run nothing")
    args = p.parse_args(argv)
    report = PartReport(args.out, f"conformance-{args.group}", dry_run=args.dry_run)
    suites = GROUPS[args.group]
    if args.dry_run:
        return report.rehearse(s.label for s in suites)
    ok = True
    for suite in suites:
        ok &= run_suite(report, suite, args.device)
    return report.finish(ok)


if __name__ == "__main__":
    raise SystemExit(main())
