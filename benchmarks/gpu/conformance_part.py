"""The conformance suites of one ``run.sh`` part on CUDA, one results file written case by case.

``corerun conformance --json`` prints its document only at the end, so a suite stopped by its time
limit would leave nothing; this driver runs the same suites, configured as that command configures
them (``--device cuda``, ``--option``, ``-k``, ``--attention``), through the same runner
(:func:`corerun.conformance.runner.run_case`), and rewrites ``--out`` before and after every case:
``running`` names the case a killed part was in.

    python benchmarks/gpu/conformance_part.py --group triton --out RESULTS/conformance-triton.json

Exit status 1 when a case failed (failed, error, xpassed), a suite that must run here is unavailable,
or one ran nothing; ``attention:flash`` is optional (flash-attn is rarely installed).
"""

from __future__ import annotations

import argparse
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
    "triton": [Suite("attention:triton"), Suite("attention:triton", options={"num_splits": 4}, keyword="decode or mixed")],
    "rest": [Suite("attention:torch"), Suite("sampler:full"), Suite("sampler:basic"), Suite("attention:flash", optional=True)],
}


def suite_class(suite: Suite, device: str) -> type:
    """The configured suite class, as ``corerun conformance`` builds it."""
    from corerun.conformance.runner import suite_class as base_class
    from corerun.conformance.settings import parse_impl

    kind, name = parse_impl(suite.impl)
    attrs: dict[str, Any] = {
        "implementation": name, "full_matrix": None, "device": device, "expected_failures": {}, "options": dict(suite.options),
    }
    if suite.attention is not None:
        attrs["attention_backend"] = suite.attention
    return type(f"Conformance_{kind}_{name}", (base_class(kind),), attrs)


def cases(suite: Suite, device: str) -> tuple[type, Any, list[Any]]:
    """(suite class, its target, the cases ``-k`` selects), in the order the runner runs them."""
    from corerun.conformance.keyword import compile_keyword

    cls = suite_class(suite, device)
    full, dev, _ = cls.settings()
    matches = compile_keyword(suite.keyword)
    target = cls.resolve_targets()[0]
    selected = [
        case for check in cls.check_names() for case in cls().build_cases(check, target, full, dev)
        if matches(f"{case.full_id} test_{check}")
    ]
    return cls, target, selected


def run_suite(report: PartReport, suite: Suite, device: str) -> bool:
    from corerun.conformance.runner import FAILING, run_case

    entry: dict[str, Any] = {"suite": suite.label}
    report.results[suite.label] = entry
    with report.check(f"{suite.label}: enumerate the cases", catch=True) as step:
        cls, target, selected = cases(suite, device)
        entry["implementation"] = target.label
        entry["unavailable_reasons"] = target.unavailable_reasons()
        entry["planned"] = len(selected)
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
    _, _, xfails = cls.settings()
    for case in selected:
        with report.check(case.full_id) as check:
            result = run_case(cls, case, xfails)
            check.update(outcome=result.outcome, reason=result.reason, ok=result.outcome not in FAILING)
            counts[result.outcome] = counts.get(result.outcome, 0) + 1
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
