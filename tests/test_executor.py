"""The executor kind: corerun's executors registered as plugins, chosen by ``distributed.executor``; the
executor conformance suite passes the ``local`` executor and rejects each broken one (a dropped step,
a hang on a dead rank, a leaked process)."""

from __future__ import annotations

import pytest

from corerun.conformance.executor_suite import ExecutorSuite
from corerun.conformance.suite import Case
from corerun.config import Config
from corerun.distributed.errors import TensorParallelError
from corerun.protocols.executor import Executor, Placement
from corerun.sdk.executor import LocalExecutor, WorkerLaunch
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
        timeout_s = 5.0  # (the dropped step's collective waits it out; starting keeps start_timeout_s)
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


class _SilentStart(LocalExecutor):
    """Starts nothing; its ``wait_for`` records the wait corerun asked for and fails as a silent rank would."""

    waits: list[tuple[str, float]] = []

    def start(self, launch: WorkerLaunch) -> None:
        self.world_size = launch.placement.world_size
        return None

    def wait_for(self, what: str, timeout_s: float) -> None:
        _SilentStart.waits.append((what, timeout_s))
        raise TensorParallelError(f"rank(s) 1 did not report {what!r} within {timeout_s:.0f} s")


@pytest.mark.parametrize(("distributed", "expect"), [
    ({"timeout_s": 7.0}, 7.0),  # unset: the collective timeout
    ({"timeout_s": 7.0, "start_timeout_s": 450.0}, 450.0),
], ids=["unset", "set"])
def test_ranks_get_start_timeout_s_to_start(distributed: dict, expect: float, tmp_path) -> None:
    """Starting ranks waits ``distributed.start_timeout_s`` (a busy host or a cold Ray worker is slow to
    start), not the collective ``timeout_s`` a user shortens to find a lost rank fast."""
    from corerun.engine.llm_engine import LLMEngine
    from corerun.plugin.hookspecs import hookimpl
    from corerun.plugin.registry import Registry
    from tests.helpers.tiny_models import make_tiny_model

    class _One:
        @hookimpl
        def corerun_executors(self, register) -> None:
            register("silent", _SilentStart, capabilities=CAPABILITIES)

    registry = Registry.from_environment()
    registry.register_module(_One(), plugin="silent", distribution="tests", version="0")
    _SilentStart.waits = []
    model = make_tiny_model(tmp_path, "llama", num_hidden_layers=2)
    config = Config(model=str(model), device="cpu", dtype="float32", tensor_parallel_size=2,
                    distributed={"executor": "silent", **distributed})
    with pytest.raises(TensorParallelError, match=f"did not report 'started' within {expect:.0f} s"):
        LLMEngine(config, registry)
    assert _SilentStart.waits == [("started", expect)]


def test_start_timeout_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match="start_timeout_s"):
        Config(distributed={"start_timeout_s": 0})
