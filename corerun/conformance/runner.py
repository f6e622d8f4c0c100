"""The programmatic runner: ``run(kind, name) -> list[CheckResult]``, used by ``corerun conformance``.

It enumerates the same checks and cases pytest would (``ConformanceSuite.check_names`` /
``build_cases``) and calls each check directly, turning pytest's outcomes (skip, xfail, fail) into
structured results.  Expected failures follow pytest's strict xfail: a listed check that fails is
``xfailed`` (with its reason), one that passes is ``xpassed`` and counts as a failure.
"""

from __future__ import annotations

import importlib
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable

from corerun.conformance.keyword import compile_keyword
from corerun.conformance.settings import parse_impl
from corerun.conformance.suite import Case, ConformanceSuite, expected_failure_reason
from corerun.registry import PluginLoadError

SUITES = {
    "attention": "corerun.conformance.attention_suite:AttentionBackendSuite",
    "kv_cache": "corerun.conformance.kv_cache_suite:KVCacheManagerSuite",
    "graph": "corerun.conformance.graph_suite:GraphRunnerSuite",
    "sampler": "corerun.conformance.sampler_suite:SamplerSuite",
    "logits_processor": "corerun.conformance.logits_processor_suite:LogitsProcessorSuite",
}
FAILING = ("failed", "error", "xpassed")
LOAD_FAILURE = "cannot build the implementation: "


@dataclass
class CheckResult:
    """One check on one case.  ``outcome`` is passed, failed, error, skipped, xfailed or xpassed."""

    kind: str
    implementation: str
    check: str
    case: str
    outcome: str
    reason: str = ""
    duration: float = 0.0

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.implementation}-{self.check}[{self.case}]"

    @property
    def failed(self) -> bool:
        return self.outcome in FAILING

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, **asdict(self)}


def suite_class(kind: str) -> type[ConformanceSuite]:
    module, _, attr = SUITES[kind].partition(":")
    return getattr(importlib.import_module(module), attr)


def run(
    kind: str,
    name: str | None = None,
    *,
    factory: Callable[..., Any] | None = None,
    capabilities: Any = None,
    options: dict[str, Any] | None = None,
    keyword: str | None = None,
    full_matrix: bool | None = None,
    device: str | None = None,
    expected_failures: dict[str, str] | None = None,
) -> list[CheckResult]:
    """Run the suite of ``kind`` against the registered implementation ``name`` (``kind`` may also be
    ``"KIND:NAME"``), or against an unregistered ``factory`` with its ``capabilities``."""
    if ":" in kind and name is None:
        kind, name = parse_impl(kind)
    base = suite_class(kind)
    attrs: dict[str, Any] = {
        "implementation": name, "options": dict(options or {}), "full_matrix": full_matrix, "device": device,
        "expected_failures": dict(expected_failures or {}), "capabilities": capabilities,
    }
    if factory is not None:
        attrs["factory"] = staticmethod(factory)
    elif name is None:
        raise ValueError("run() needs a registered name or a factory")
    cls = type(f"Conformance_{kind}_{name or 'custom'}", (base,), attrs)
    return run_suite(cls, keyword=keyword)


def run_suite(cls: type[ConformanceSuite], keyword: str | None = None, progress: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    """Every (check, case) of a configured suite class whose id matches ``keyword``."""
    full, device, xfails = cls.settings()
    matches = compile_keyword(keyword)
    results: list[CheckResult] = []
    for target in cls.resolve_targets():
        for check in cls.check_names():
            for case in cls().build_cases(check, target, full, device):
                if not matches(f"{case.full_id} test_{check}"):
                    continue
                result = run_case(cls, case, xfails)
                results.append(result)
                if progress is not None:
                    progress(result)
                if result.outcome == "error" and result.reason.startswith(LOAD_FAILURE):
                    return results  # the implementation cannot be built at all: one error, not one per case
    return results


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def run_case(cls: type[ConformanceSuite], case: Case, xfails: dict[str, str]) -> CheckResult:
    """Run one check on one case and classify the outcome."""
    import pytest

    start = time.perf_counter()
    try:
        getattr(cls(), f"test_{case.check}")(case)
        outcome, reason = "passed", ""
    except pytest.skip.Exception as exc:
        outcome, reason = "skipped", str(exc.msg)
    except pytest.xfail.Exception as exc:
        outcome, reason = "xfailed", str(exc.msg)
    except PluginLoadError as exc:
        if exc.import_failure:
            outcome, reason = "error", f"{LOAD_FAILURE}{exc}; the remaining checks were not run"
        else:
            outcome, reason = "error", str(exc)
    except pytest.fail.Exception as exc:
        outcome, reason = "failed", str(exc.msg)
    except AssertionError as exc:
        outcome, reason = "failed", str(exc) or traceback.format_exc(limit=-1)
    except Exception as exc:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        outcome, reason = "error", f"{type(exc).__name__}: {exc} (at {frame.filename}:{frame.lineno})"
    expected = expected_failure_reason(xfails, case)
    if expected is not None:
        if outcome in ("failed", "error"):
            outcome, reason = "xfailed", f"{expected} [{_first_line(reason)}]"
        elif outcome == "passed":
            outcome, reason = "xpassed", f"expected to fail ({expected}) but passed"
    return CheckResult(case.target.kind, case.target.name, case.check, case.id, outcome, reason, time.perf_counter() - start)


def summarize(results: list[CheckResult]) -> dict[str, int]:
    counts = {k: 0 for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    return counts
