"""What a conformance report says about failures: identical failures grouped (one block listing the
cases) and one line of diagnosis per failed check.  Plain data for ``corerun conformance``'s report."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

DIAGNOSIS_WIDTH = 110


@dataclass
class FailureGroup:
    """Cases of one check that failed alike: the same words once each case's own id and every figure
    are left out.  ``reason`` is the first case's; ``identical`` when every case gave exactly it."""

    outcome: str
    check: str
    reason: str
    cases: list[str] = field(default_factory=list)
    identical: bool = True


_FIGURE = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def _same_failure(result: Any) -> tuple[str, str, str]:
    reason = result.reason.replace(result.case, "{case}") if result.case else result.reason
    return result.outcome, result.check, _FIGURE.sub("#", reason)


def group_failures(results: list[Any]) -> list[FailureGroup]:
    """The failed, errored and unexpectedly passed results as groups of alike failures, in run order."""
    groups: dict[tuple[str, str, str], FailureGroup] = {}
    for r in results:
        if r.failed:
            group = groups.setdefault(_same_failure(r), FailureGroup(r.outcome, r.check, r.reason))
            if group.cases and r.reason.replace(r.case, "") != group.reason.replace(group.cases[0], ""):
                group.identical = False
            group.cases.append(r.case)
    return list(groups.values())


def _first_line(text: str) -> str:
    """A reason's headline: its first line, with the next one when the first only introduces a list."""
    lines = [line.strip().removeprefix("- ") for line in text.splitlines() if line.strip()]
    if not lines:
        return "no reason given"
    line = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return line if len(line) <= DIAGNOSIS_WIDTH else line[: DIAGNOSIS_WIDTH - 3] + "..."


def _parts(case: str) -> set[str]:
    return {p for p in re.split(r"[-_+,\s]+", case) if p}


def _only_in_failures(failed: list[str], passed: list[str]) -> list[str]:
    """The parts of a case id (``fp16``, ``gqa4``, ``bs16``) every failed case has and no passed one."""
    if not failed or not passed:
        return []
    common = set.intersection(*(_parts(c) for c in failed))
    seen = set().union(*(_parts(c) for c in passed))
    return sorted(common - seen)


def diagnose(results: list[Any]) -> list[str]:
    """One line per check with a failure: how many of its cases failed, the most common reason's first
    line, and what the failing cases share that no passing case has (``gqa4``: a GQA mistake)."""
    lines = []
    checks = list(dict.fromkeys(r.check for r in results if r.failed))
    for check in checks:
        mine = [r for r in results if r.check == check]
        failed = [r for r in mine if r.failed]
        passed = [r.case for r in mine if r.outcome == "passed"]
        reasons = Counter(_same_failure(r)[2] for r in failed)
        reason = next(r.reason for r in failed if _same_failure(r)[2] == reasons.most_common(1)[0][0])
        line = f"{check}: {len(failed)} of {len(mine)} cases failed; {_first_line(reason)}"
        if len(reasons) > 1:
            line += f" (and {len(reasons) - 1} other failure{'s' if len(reasons) > 2 else ''})"
        shared = _only_in_failures([r.case for r in failed], passed)
        if shared:
            line += f"; only cases with {', '.join(shared)} fail"
        lines.append(line)
    return lines
