"""The executor kind: corerun's executors registered as plugins, chosen by ``distributed.executor``; the
executor conformance suite passes the ``local`` executor and rejects each broken one (a dropped step,
a hang on a dead rank, a leaked process)."""

from __future__ import annotations

import pytest

from corerun.conformance.executor_suite import ExecutorSuite
from corerun.conformance.suite import Case
from corerun.config import Config
from corerun.protocols.executor import Executor, Placement
from tests.broken_impls.executor import CAPABILITIES, DropsAStep, HangsOnADeadRank, LeaksAProcess


def test_hook_corerun_executors() -> None:
    """The built-ins are registered through the hook with their capabilities, and each builds an Executor."""
    from corerun.plugin.registry import Registry

    registry = Registry.from_environment()
    assert {"inproc", "local", "launched"} <= set(registry.names("executor"))
    caps = {n: registry.get("executor", n).capabilities for n in ("inproc", "local", "launched")}
    assert caps["inproc"].max_world_size == 1 and not caps["local"].multi_host and caps["launched"].multi_host
    assert caps["local"].starts_ranks and not caps["launched"].starts_ranks
    for name in caps:
        assert isinstance(registry.create("executor", name), Executor)


def test_auto_picks_by_placement_and_init_method() -> None:
    from corerun.executor.select import executor_name

    one, two = Placement(1, 1, ((0, 0),)), Placement(2, 1, ((0, 0),))
    assert executor_name(Config(), one) == "inproc"
    assert executor_name(Config(), two) == "local"
    assert executor_name(Config(distributed={"init_method": "env://"}), two) == "launched"
    assert executor_name(Config(distributed={"executor": "mine"}), one) == "mine"


def test_stages_split_evenly_or_as_stated() -> None:
    assert Placement.of(1, 3, 8).stage_layers == ((0, 3), (3, 6), (6, 8))  # the first stages one more
    assert Placement.of(2, 2, 8, [3, 5]).stage_layers == ((0, 3), (3, 8))
    assert Placement.of(2, 2, 8).last_stage_rank == 2 and Placement.of(2, 2, 8).ranks_of_stage(1) == [2, 3]
    with pytest.raises(ValueError, match=r"pipeline_layers \[4, 5\] must give 2 stages .* summing to the model's 8 layers"):
        Placement.of(1, 2, 8, [4, 5])


class TestLocalExecutor(ExecutorSuite):
    implementation = "local"


def _check(broken, check: str, placement: str = "tp2") -> None:
    class Suite(ExecutorSuite):  # short waits: each broken executor fails by waiting them out
        timeout_s = 5.0  # (a loaded machine starts a forked rank within it; the dropped step's collective waits it out)
        lost_rank_grace_s = 3.0
        leak_grace_s = 2.0

    Suite.factory, Suite.capabilities = broken, CAPABILITIES
    target = Suite.resolve_targets()[0]
    tp_pp = {"tp2": (2, 1), "pp2": (1, 2)}[placement]
    getattr(Suite(), f"test_{check}")(Case(target, check, placement, tp_pp, "cpu"))


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("broken", "check", "message"), [
    (DropsAStep, "greedy", "requests ended with errors"),
    (HangsOnADeadRank, "lost_rank", "did not end its requests within"),
    (LeaksAProcess, "no_leaks", "outlived shutdown"),
], ids=["drops-a-step", "hangs-on-a-dead-rank", "leaks-a-process"])
def test_broken_executors_are_rejected(broken, check: str, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        _check(broken, check)


@pytest.mark.timeout(420)
def test_scaffolded_executor_passes_the_suite_unedited(tmp_path, monkeypatch) -> None:
    """``corerun new executor fresh`` writes an executor (its own processes and pipes, not corerun's local
    executor) that passes every check of the suite as written."""
    import sys

    from corerun.conformance import run
    from corerun.scaffold import scaffold

    root = scaffold("executor", "fresh", tmp_path)
    monkeypatch.syspath_prepend(str(root))
    from corerun_executor_fresh.executor import Executor as Fresh
    from corerun_executor_fresh.plugin import CAPABILITIES as FRESH

    results = run("executor", factory=Fresh, capabilities=FRESH, name="fresh")
    assert [(r.id, r.outcome, r.reason) for r in results if r.outcome != "passed"] == []
    assert sorted(r.id for r in results) == [
        "executor-fresh-greedy[pp2]", "executor-fresh-greedy[tp2]", "executor-fresh-lost_rank[pp2]",
        "executor-fresh-no_leaks[pp2]",
    ]
    assert "`distributed: {executor: fresh}`" in (root / "README.md").read_text()
    for module in [m for m in sys.modules if m.startswith("corerun_executor_fresh")]:
        monkeypatch.delitem(sys.modules, module)
