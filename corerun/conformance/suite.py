"""The base of the four umbrella suites: targets, case generation, expected failures, pytest wiring.

A suite is a plain pytest class (its name does not start with ``Test``, so it is only collected
through a subclass).  Each ``test_<check>(self, case)`` method is one check; ``pytest_generate_tests``
parametrises ``case`` from what the implementation declares.  ``corerun conformance`` and
:func:`corerun.conformance.run` collect and run these same classes through pytest
(:mod:`corerun.conformance.runner`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from corerun.conformance.settings import FROM_OPTION, env_device, env_full_matrix, parse_xfail
from corerun.conformance.target import Target

__all__ = ["FROM_OPTION", "Case", "ConformanceSuite", "expected_failure_reason"]


@dataclass(frozen=True)
class Case:
    """One parametrisation of one check.

    ``id`` is stable and readable (``bf16-hd128-bs16-gqa4``); ``config`` is the suite's own
    description of the case; ``skip`` is a reason this case cannot run (it is reported as skipped).
    """

    target: Target
    check: str
    id: str
    config: Any
    device: str
    skip: str | None = None

    @property
    def key(self) -> str:
        """``decode[bf16-hd128-bs16-gqa4]``: what expected-failure patterns match."""
        return f"{self.check}[{self.id}]"

    @property
    def full_id(self) -> str:
        """``attention-torch-decode[bf16-hd128-bs16-gqa4]``."""
        return f"{self.target.kind}-{self.target.name}-{self.key}"


def _glob(pattern: str) -> str:
    """``*`` and ``?`` are wildcards; brackets are literal (case ids contain them)."""
    return "".join("[[]" if c == "[" else "[]]" if c == "]" else c for c in pattern)


def expected_failure_reason(patterns: dict[str, str], case: Case) -> str | None:
    """The reason of the first pattern matching ``check[case]`` (or the bare check name), if any.

    Patterns use ``*`` and ``?`` as wildcards (``decode[bf16-*]``); brackets match themselves.
    """
    for pattern, reason in patterns.items():
        glob = _glob(pattern)
        if fnmatch.fnmatchcase(case.key, glob) or fnmatch.fnmatchcase(case.check, glob):
            if not str(reason).strip():
                raise ValueError(f"expected failure {pattern!r} has no reason; every expected failure must state why")
            return str(reason)
    return None


class ConformanceSuite:
    """Shared machinery; subclass one of the four protocol suites, not this class.

    Class attributes a user sets (in a subclass):

    - ``implementation``: the registered name to check (``"torch"``), or
    - ``factory`` (``staticmethod(make)`` or a class) plus ``capabilities`` for an unregistered one;
    - ``options``: keyword options handed to the factory;
    - ``expected_failures``: ``{"decode[bf16-*]": "reason"}``; fnmatch patterns over ``check[case]``
      (a bare check name matches all its cases).  A listed check that fails is reported xfailed with
      the reason, one that passes is an error (xpassed, strict);
    - ``device``: force ``"cpu"`` or ``"cuda"`` (default: cuda when available and declared, else cpu);
    - ``full_matrix``: the full cross product of declared capabilities (default: a covering sample).
    """

    kind: ClassVar[str] = ""
    implementation: ClassVar[str | None] = None
    factory: ClassVar[Callable[..., Any] | None] = None
    capabilities: ClassVar[Any] = None
    options: ClassVar[dict[str, Any]] = {}
    expected_failures: ClassVar[dict[str, str]] = {}
    device: ClassVar[str | None] = None
    full_matrix: ClassVar[bool | None] = None

    # ------------------------------------------------------------ subclass API
    def configs(self, check: str, target: Target, full: bool) -> list[tuple[str, Any]] | str:
        """``[(case id, config), ...]`` for ``check``, or a string: why the check has no case here."""
        raise NotImplementedError

    def pick_device(self, target: Target) -> str:
        """The device cases run on when none is forced: cuda when available and declared, else cpu."""
        import torch

        devices = getattr(target.capabilities, "devices", None) or frozenset({"cpu", "cuda"})
        if "cuda" in devices and torch.cuda.is_available():
            return "cuda"
        if "cpu" in devices:
            return "cpu"
        return "cuda"

    # ------------------------------------------------------------ enumeration
    @classmethod
    def resolve_targets(cls, config: Any = None) -> list[Target]:
        """The implementations this class checks (``--corerun-impl`` ones for an option-driven class)."""
        factory = cls.factory  # a staticmethod, a plain function or a class all come back callable
        if cls.implementation == FROM_OPTION:
            from corerun.conformance.pytest_plugin import selected_targets

            return selected_targets(config, cls.kind, cls.options)
        if factory is not None:
            return [Target.from_factory(cls.kind, factory, cls.capabilities, cls.implementation, cls.options)]
        if cls.implementation:
            return [Target.registered(cls.kind, cls.implementation, cls.options, cls.capabilities)]
        raise TypeError(
            f"{cls.__name__} names no implementation: set `implementation = \"NAME\"` (a registered "
            f"{cls.kind} implementation) or `factory = staticmethod(make)` with `capabilities = ...`"
        )

    @classmethod
    def settings(cls, config: Any = None) -> tuple[bool, str | None, dict[str, str]]:
        """``(full_matrix, forced device, expected failures)`` from the class, pytest options and environment."""
        full = cls.full_matrix
        if full is None:
            full = bool(config is not None and config.getoption("corerun_full_matrix", False)) or env_full_matrix()
        device = cls.device or (config.getoption("corerun_device", None) if config is not None else None) or env_device()
        xfails = dict(cls.expected_failures)
        for spec in (config.getoption("corerun_xfail", None) or []) if config is not None else []:
            pattern, reason = parse_xfail(spec)
            xfails[pattern] = reason
        for pattern, reason in xfails.items():
            if not str(reason).strip():
                raise ValueError(f"expected failure {pattern!r} has no reason; every expected failure must state why")
        return full, device, xfails

    def build_cases(self, check: str, target: Target, full: bool, device: str | None) -> list[Case]:
        """The cases of ``check`` for ``target`` (one skipped case, with the reason, when there are none)."""
        dev = device or self.pick_device(target)
        made = self.configs(check, target, full)
        if isinstance(made, str):
            return [Case(target, check, "none", None, dev, skip=made)]
        return [Case(target, check, cid, cfg, dev) for cid, cfg in made]

    # ------------------------------------------------------------ pytest wiring
    def pytest_generate_tests(self, metafunc: Any) -> None:
        if "case" not in metafunc.fixturenames or metafunc.cls is None:
            return
        import pytest

        cls = metafunc.cls
        check = metafunc.function.__name__.removeprefix("test_")
        full, device, xfails = cls.settings(metafunc.config)
        targets = cls.resolve_targets(metafunc.config)
        if not targets:
            reason = f"no --corerun-impl {cls.kind}:NAME given"
            metafunc.parametrize("case", [pytest.param(None, id="no-impl", marks=pytest.mark.skip(reason=reason))])
            return
        params = []
        suite = self  # an instance of cls, which a subclass may have configured from metafunc.config
        for target in targets:
            for case in suite.build_cases(check, target, full, device):
                marks = []
                reason = expected_failure_reason(xfails, case)
                if reason is not None:
                    marks.append(pytest.mark.xfail(reason=reason, strict=True))
                pid = case.id if len(targets) == 1 else f"{target.name}-{case.id}"
                params.append(pytest.param(case, id=pid, marks=marks))
        metafunc.parametrize("case", params)

    # ------------------------------------------------------------ per test
    def start(self, case: Case | None) -> None:
        """Skip (with the reason) when the implementation or the device is unavailable; seed the RNGs."""
        import pytest
        import torch

        if case is None:
            pytest.skip("no implementation selected")
        reasons = case.target.unavailable_reasons()
        if reasons:
            pytest.skip(f"{case.target.label} is unavailable here: " + "; ".join(reasons))
        if case.skip:
            pytest.skip(case.skip)
        if case.device.startswith("cuda") and not torch.cuda.is_available():
            pytest.skip(f"{case.target.label} runs on cuda here and no CUDA device is available")
        torch.manual_seed(20240917)
