"""The conformance suites of one ``run.sh`` part on CUDA, one results file written case by case.

``corerun conformance --json`` prints its document only at the end, so a suite stopped by its time
limit would leave nothing; this driver runs the same suites, configured as that command configures
them (``--device cuda``, ``--option``, ``-k``, ``--attention``), through the same pytest invocation
(:func:`corerun.conformance.runner.invoke`), and rewrites ``--out`` before and after every case:
``running`` names the case a killed part was in.

    python benchmarks/gpu/conformance_part.py --group triton --out RESULTS/conformance-triton.json

Exit status 1 when a case failed (failed, error, xpassed), a suite that must run here is unavailable,
or one ran nothing; ``attention:flash`` is optional (flash-attn is rarely installed).
"""

from __future__ import annotations

import argparse
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


# Most important first inside each group: a part cut short keeps what ran.
GROUPS: dict[str, list[Suite]] = {
    "graph": [Suite("graph:cuda"), Suite("graph:cuda", attention="triton")],
    "triton": [Suite("attention:triton"), Suite("attention:triton", options={"num_splits": 4}, keyword="decode or mixed"),
               Suite("lora:triton")],
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


def run_suite(report: PartReport, suite: Suite, device: str) -> bool:
    from corerun.conformance.runner import FAILING, ResultCollector, invoke

    entry: dict[str, Any] = {"suite": suite.label}
    report.results[suite.label] = entry
    with report.check(f"{suite.label}: enumerate the cases", catch=True) as step:
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
    collector = ResultCollector(suite.impl, progress=per_case.result)
    invoke(pytest_args(suite, device), collector, plugins=[per_case])
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
