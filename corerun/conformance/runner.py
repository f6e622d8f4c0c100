"""Running the suites through pytest, in-process: ``corerun conformance`` and ``run(kind, name)``.

Both call ``pytest.main`` on ``--pyargs corerun.conformance``, the collection that
``pytest --pyargs corerun.conformance --corerun-impl KIND:NAME`` makes, with their settings mapped
onto the plugin's ``--corerun-*`` options and pytest's ``-k``: selection, parametrisation, skips and
strict expected failures are pytest's, so the command line and pytest cannot disagree.
:class:`ResultCollector`, a plugin object handed to ``pytest.main``, turns pytest's reports into
:class:`CheckResult` rows.  pytest runs isolated from the caller's directory: no ini file, no
``conftest.py``, no cache, no terminal output (the caller prints its own report).
"""

from __future__ import annotations

import os
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable

import pytest

from corerun.conformance.settings import KIND_ALIASES, KINDS, parse_impl
from corerun.conformance.target import Target
from corerun.plugin.registry import PluginLoadError

PACKAGE = "corerun.conformance"
SUITES = {
    "attention": "corerun.conformance.attention_suite:AttentionBackendSuite",
    "kv_cache": "corerun.conformance.kv_cache_suite:KVCacheManagerSuite",
    "graph": "corerun.conformance.graph_suite:GraphRunnerSuite",
    "sampler": "corerun.conformance.sampler_suite:SamplerSuite",
    "logits_processor": "corerun.conformance.logits_processor_suite:LogitsProcessorSuite",
    "tool_parser": "corerun.conformance.tool_parser_suite:ToolParserSuite",
    "reasoning_parser": "corerun.conformance.tool_parser_suite:ReasoningParserSuite",
    "model": "corerun.conformance.model_suite:ModelSuite",
    "quantization": "corerun.conformance.quantization_suite:QuantizationSuite",
    "lora": "corerun.conformance.lora_suite:LoRAKernelSuite",
    "executor": "corerun.conformance.executor_suite:ExecutorSuite",
    "fused_ops": "corerun.conformance.fused_ops_suite:FusedOpsSuite",
}
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
FAILING = ("failed", "error", "xpassed")
LOAD_FAILURE = "cannot build the implementation: "


@dataclass
class CheckResult:
    """One check on one case.  ``outcome`` is passed, failed, error, skipped, xfailed or xpassed;
    ``nodeid`` is pytest's id of the test (``test_selected.py::TestSampler::test_seeds[default]``)."""

    kind: str
    implementation: str
    check: str
    case: str
    outcome: str
    reason: str = ""
    duration: float = 0.0
    nodeid: str = ""

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.implementation}-{self.check}[{self.case}]"

    @property
    def failed(self) -> bool:
        return self.outcome in FAILING

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, **asdict(self)}


def suite_class(kind: str) -> type:
    import importlib

    module, _, attr = SUITES[kind].partition(":")
    return getattr(importlib.import_module(module), attr)


def pytest_args(
    impl: str, *, keyword: str | None = None, full_matrix: bool = False, device: str | None = None,
    xfails: dict[str, str] | None = None, options: tuple[str, ...] | list[str] = (), attention: str | None = None,
) -> list[str]:
    """The pytest command line (after ``pytest``) that runs the suite of ``impl`` (``KIND:NAME``)."""
    args = ["--pyargs", PACKAGE, "--corerun-impl", impl]
    if keyword:
        args += ["-k", keyword]
    if full_matrix:
        args.append("--corerun-full-matrix")
    if device:
        args += ["--corerun-device", device]
    for pattern, reason in (xfails or {}).items():
        args += ["--corerun-xfail", f"{pattern}={reason}"]
    for item in options:
        args += ["--corerun-option", item]
    if attention:
        args += ["--corerun-attention", attention]
    return args


def _isolation() -> list[str]:
    """No ini file, conftest, cache or terminal of the current directory; ids relative to the package;
    the corerun plugin named so it loads even when plugin autoloading is off."""
    import corerun.conformance as package

    root = os.path.dirname(os.path.abspath(package.__file__))
    return ["-c", os.devnull, "--rootdir", root, "--noconftest", "--import-mode=importlib",
            "-p", "no:cacheprovider", "-p", "no:terminal", "-p", "corerun"]


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _describe(exc: BaseException) -> tuple[str, str]:
    """``(outcome, reason)`` of an exception a check raised: ``failed`` for the suite's verdicts,
    ``error`` when the implementation itself raised."""
    if isinstance(exc, PluginLoadError):
        if exc.import_failure:
            return "error", f"{LOAD_FAILURE}{exc}; the remaining checks were not run"
        return "error", str(exc)
    if isinstance(exc, pytest.fail.Exception):
        return "failed", str(exc.msg)
    if isinstance(exc, AssertionError):
        return "failed", str(exc) or "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-1))
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return "error", f"{type(exc).__name__}: {exc} (at {frame.filename}:{frame.lineno})"


def _classify(call: Any, report: Any) -> tuple[str, str] | None:
    """``(outcome, reason)`` of one phase of a test, or ``None`` for a setup or teardown that passed."""
    exc = call.excinfo.value if call.excinfo is not None else None
    if report.passed:
        return ("passed", "") if report.when == "call" else None
    if report.skipped:
        expected = getattr(report, "wasxfail", None)
        if expected is None:
            return "skipped", str(getattr(exc, "msg", None) or exc or "")
        if exc is None or isinstance(exc, pytest.xfail.Exception):
            return "xfailed", str(getattr(exc, "msg", None) or expected)
        return "xfailed", f"{expected} [{_first_line(_describe(exc)[1])}]"
    if exc is None:  # a strict expected failure that passed: "[XPASS(strict)] reason"
        expected = str(report.longrepr).removeprefix("[XPASS(strict)]").strip()
        return "xpassed", f"expected to fail ({expected}) but passed"
    outcome, reason = _describe(exc)
    return (outcome if report.when == "call" else "error"), reason


class ResultCollector:
    """The plugin object ``pytest.main`` gets: one :class:`CheckResult` per test, in run order.

    ``targets`` ({(kind, name): Target}) hands implementations that are not registered to the
    ``--corerun-impl`` names that select them; ``progress`` is called with each result.
    """

    def __init__(self, impl: str, targets: dict[tuple[str, str], Target] | None = None,
                 progress: Callable[[CheckResult], None] | None = None) -> None:
        self.kind, self.name = parse_impl(impl)
        self.targets = dict(targets or {})
        self.progress = progress
        self.cases: dict[str, Any] = {}  # nodeid -> the test's Case (None when it has none)
        self.by_id: dict[str, CheckResult] = {}
        self.stopped: str | None = None  # why the run stopped early (the implementation cannot be built)
        self.usage_error: str | None = None

    @property
    def results(self) -> list[CheckResult]:
        return list(self.by_id.values())

    # ------------------------------------------------------------ hooks
    def pytest_configure(self, config: Any) -> None:
        from corerun.conformance.pytest_plugin import TARGETS

        if self.targets:
            config.stash[TARGETS] = self.targets

    @pytest.hookimpl(hookwrapper=True)
    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> Any:
        outcome = yield
        if isinstance(outcome.excinfo and outcome.excinfo[1], pytest.UsageError):  # a malformed -k expression
            self.usage_error = str(outcome.excinfo[1])

    def pytest_collection_finish(self, session: Any) -> None:
        for item in session.items:
            callspec = getattr(item, "callspec", None)
            self.cases[item.nodeid] = callspec.params.get("case") if callspec is not None else None

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:  # pytest then stops before running anything
            where = report.nodeid or PACKAGE
            self.stopped = f"{where} could not be collected"
            self._add(CheckResult(self.kind, self.name, "collection", where, "error", report.longreprtext, nodeid=where))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: Any, call: Any) -> Any:
        outcome = yield
        report = outcome.get_result()
        report.corerun_outcome = _classify(call, report)
        if report.corerun_outcome and report.corerun_outcome[1].startswith(LOAD_FAILURE):
            self.stopped = item.session.shouldstop = report.corerun_outcome[1]

    def pytest_runtest_logreport(self, report: Any) -> None:
        classified = getattr(report, "corerun_outcome", None)
        if classified is None:
            return
        outcome, reason = classified
        earlier = self.by_id.get(report.nodeid)
        if earlier is not None:  # a teardown error after the test ran: the test's result becomes an error
            if earlier.outcome == "passed" and outcome == "error":
                earlier.outcome, earlier.reason = outcome, reason
            return
        case = self.cases.get(report.nodeid)
        if case is not None:
            kind, name, check, case_id = case.target.kind, case.target.name, case.check, case.id
        else:
            kind, name = self.kind, self.name
            check = report.nodeid.split("::")[-1].split("[")[0].removeprefix("test_")
            case_id = report.nodeid.partition("[")[2].rstrip("]")
        self._add(CheckResult(kind, name, check, case_id, outcome, reason, report.duration, report.nodeid))

    def _add(self, result: CheckResult) -> None:
        self.by_id[result.nodeid] = result
        if self.progress is not None:
            self.progress(result)


def invoke(args: list[str], collector: ResultCollector, *, collect_only: bool = False, plugins: list[Any] = ()) -> int:
    """``pytest.main(args)`` in this process with ``collector`` (and ``plugins``) as plugins; pytest's
    exit status.  A usage error (a malformed ``-k``) raises ValueError, an internal error
    RuntimeError, Ctrl-C KeyboardInterrupt."""
    full = [*_isolation(), *args, *(["--collect-only"] if collect_only else [])]
    code = pytest.main(full, plugins=[collector, *plugins])
    if code == pytest.ExitCode.USAGE_ERROR:
        raise ValueError(collector.usage_error or f"pytest refused its arguments {' '.join(args)} (see its message above)")
    if code == pytest.ExitCode.INTERNAL_ERROR:
        raise RuntimeError(f"pytest stopped with an internal error running {' '.join(args)} (see its message above)")
    if code == pytest.ExitCode.INTERRUPTED and collector.stopped is None:
        raise KeyboardInterrupt
    return int(code)


def _target(kind: str, name: str | None, factory: Callable[..., Any] | None, capabilities: Any, options: dict | None) -> Target:
    kind = KIND_ALIASES.get(kind, kind)
    if kind not in KINDS:
        raise ValueError(f"unknown implementation kind {kind!r}; kinds are {', '.join(KINDS)}")
    if factory is not None:
        return Target.from_factory(kind, factory, capabilities, name, options)
    if name is None:
        raise ValueError("run() needs a registered name or a factory")
    return Target.registered(kind, name, options, capabilities)


def _checked_xfails(expected_failures: dict[str, str] | None) -> dict[str, str]:
    xfails = dict(expected_failures or {})
    for pattern, reason in xfails.items():
        if not str(reason).strip():
            raise ValueError(f"expected failure {pattern!r} has no reason; every expected failure must state why")
        if "=" in pattern:
            raise ValueError(f"expected failure pattern {pattern!r} contains '=', which separates a pattern from its reason")
    return xfails


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
    ``"KIND:NAME"``), or against an unregistered ``factory`` with its ``capabilities``.

    ``keyword`` is pytest's ``-k`` expression."""
    if ":" in kind and name is None:
        kind, name = parse_impl(kind)
    target = _target(kind, name, factory, capabilities, options)
    results, _ = run_suite(f"{target.kind}:{target.name}", targets={(target.kind, target.name): target},
                           keyword=keyword, full_matrix=full_matrix, device=device,
                           xfails=_checked_xfails(expected_failures))
    return results


def run_suite(
    impl: str, *, keyword: str | None = None, full_matrix: bool | None = None, device: str | None = None,
    xfails: dict[str, str] | None = None, options: tuple[str, ...] | list[str] = (), attention: str | None = None,
    targets: dict[tuple[str, str], Target] | None = None, progress: Callable[[CheckResult], None] | None = None,
) -> tuple[list[CheckResult], list[str]]:
    """Run the suite of ``impl`` (``KIND:NAME``) through pytest in this process (``run()`` and
    ``corerun conformance``); its results and the pytest command line (after ``pytest``) that ran it.

    The settings are :func:`pytest_args`'s (``full_matrix`` None or False adds no option, so
    ``CORERUN_FULL_MATRIX`` still applies); ``targets`` and ``progress`` are :class:`ResultCollector`'s."""
    args = pytest_args(impl, keyword=keyword, full_matrix=bool(full_matrix), device=device, xfails=xfails,
                       options=options, attention=attention)
    collector = ResultCollector(impl, targets=targets, progress=progress)
    invoke(args, collector)
    return collector.results, args


def summarize(results: list[CheckResult]) -> dict[str, int]:
    counts = {k: 0 for k in OUTCOMES}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    return counts
