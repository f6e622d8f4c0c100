"""The executor conformance suite: an executor's placements run a tiny model exactly as one process does,
a rank killed mid-run is named within the timeout, and nothing it started outlives the engine.

Every case builds a whole engine (``LLMEngine``) on a tiny random Llama (4 layers, float32, CPU, gloo)
with ``distributed.executor`` set to the implementation, and steps it by hand.  Checks:

- ``greedy``: for every placement the executor declares it starts (``tp2``: 2 tensor-parallel ranks;
  ``pp2``: 2 pipeline stages, when ``pipeline_parallel``), the greedy tokens of a few prompts (a
  shared prefix, a prompt longer than a step's token budget: prefix-cache hits and chunked prefill)
  equal those of the in-process run, token for token, with no request ending in an error;
- ``lost_rank``: the last rank's process (``executor.pids``) is killed after the first step; every
  request ends with an error naming that rank (``"rank N"``) within ``timeout_s`` (the
  ``distributed.timeout_s`` the engine runs with, plus ``lost_rank_grace_s``), a later request is refused with an
  error, and ``shutdown()`` returns; skipped for an executor whose ranks are not this host's processes;
- ``no_leaks``: after ``shutdown()`` every process the executor listed is gone, and this process has no
  child it did not have before the engine started (within ``leak_grace_s``).

``timeout_s``, ``lost_rank_grace_s`` and ``leak_grace_s`` are class settings: a suite for an executor
expected to fail (corerun's own broken ones) sets them short so that the failure shows in seconds.

Adopt it with::

    class TestMine(ExecutorSuite):
        implementation = "mine"
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

from corerun.conformance.suite import Case, ConformanceSuite
from corerun.conformance.target import Target

LAYERS = 4
MAX_TOKENS = 6
ENGINE = dict(
    device="cpu", dtype="float32", attention="torch",
    kv_cache={"block_size": 4, "num_blocks": 32},
    scheduler={"max_model_len": 96, "max_num_batched_tokens": 16, "max_num_seqs": 4},  # chunked prefill
)
PLACEMENTS = {"tp2": (2, 1), "pp2": (1, 2)}
_MODELS: dict[str, Path] = {}
_REFERENCE: dict[str, list[list[int]]] = {}


def _prompts() -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(5)
    rnd = lambda n: torch.randint(3, 250, (n,), generator=g).tolist()  # noqa: E731
    shared = rnd(8)
    return [rnd(3), shared + rnd(2), shared + rnd(5), rnd(21)]


def tiny_model() -> Path:
    """A 4-layer random Llama written once per process (4 query / 2 KV heads: splits over 2 ranks)."""
    if "llama" not in _MODELS:
        import tempfile

        from corerun.testing.tiny_models import make_tiny_model

        _MODELS["llama"] = make_tiny_model(tempfile.mkdtemp(prefix="corerun-executor-suite-"), "llama",
                                           num_hidden_layers=LAYERS, vocab_size=254)
    return _MODELS["llama"]


SHARED_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver")  # one per process, kept


def _children() -> set[int]:
    """Process ids whose parent is this process (zombies included: not reaped is not gone), but for the
    helpers Python's multiprocessing keeps for the whole process (resource tracker, fork server)."""
    me, found = str(os.getpid()), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if fields[1] == me and not any(h in cmdline for h in SHARED_HELPERS):
                found.add(int(entry))
    return found


def gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie nobody has reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _kill(pids: set[int] | list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, os.WNOHANG)
        except (ProcessLookupError, ChildProcessError):
            pass


class ExecutorSuite(ConformanceSuite):
    """The executor conformance suite (see the module docstring)."""

    kind = "executor"
    timeout_s: ClassVar[float] = 30.0  # distributed.timeout_s of the engines it builds
    start_timeout_s: ClassVar[float] = 300.0  # distributed.start_timeout_s: a busy host starts ranks slowly
    lost_rank_grace_s: ClassVar[float] = 15.0  # beyond timeout_s, for the requests to end after a rank's death
    leak_grace_s: ClassVar[float] = 10.0  # how long the executor's processes may take to be reaped after shutdown()

    def configs(self, check: str, target: Target, full: bool) -> list[tuple[str, Any]] | str:
        caps = target.capabilities
        if caps.max_world_size is not None and caps.max_world_size < 2:
            return f"{target.label} starts one rank at most: the in-process run is all it does"
        if not getattr(caps, "starts_ranks", True):
            return f"{target.label} joins ranks started elsewhere (starts_ranks=False): the suite cannot start them"
        names = ["tp2"] + (["pp2"] if caps.pipeline_parallel else [])
        if check == "greedy":
            return [(n, PLACEMENTS[n]) for n in names]
        return [(names[-1], PLACEMENTS[names[-1]])]  # one placement: each case starts processes

    def pick_device(self, target: Target) -> str:
        return "cpu"  # gloo on CPU processes: what every executor can run here

    # ------------------------------------------------------------ helpers
    def registry(self, target: Target) -> Any:
        """The process-wide registry for a registered executor; for a factory, one that also holds it."""
        from corerun.plugin.registry import Registry, get_registry

        if target.registration is not None:
            return get_registry()
        from corerun.plugin.hookspecs import hookimpl

        factory, caps, name = target.factory, target.capabilities, target.name

        class _One:
            @hookimpl
            def corerun_executors(self, register: Any) -> None:
                register(name, factory, capabilities=caps)

        registry = Registry.from_environment()
        registry.register_module(_One(), plugin=f"conformance-{name}", distribution="conformance", version="0")
        return registry

    def engine(self, target: Target | None, tp: int = 1, pp: int = 1) -> Any:
        """An engine on the tiny model; ``target`` None: the in-process run."""
        from corerun.config import Config
        from corerun.engine.llm_engine import LLMEngine

        distributed: dict[str, Any] = {"timeout_s": self.timeout_s, "start_timeout_s": self.start_timeout_s,
                                       "start_method": "forkserver"}  # (local's)
        if target is not None:
            distributed.update(executor=target.name, executor_options=dict(target.options))
        config = Config(model=str(tiny_model()), tensor_parallel_size=tp, pipeline_parallel_size=pp,
                        distributed=distributed, **ENGINE)
        return LLMEngine(config, self.registry(target) if target is not None else None)

    @staticmethod
    def generate(engine: Any, max_tokens: int = MAX_TOKENS) -> list[Any]:
        from corerun.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in _prompts()]
        seqs = {s.request_id: s for s in (engine.requests[i] for i in ids)}
        while engine.has_unfinished_requests():
            engine.step()
        return [seqs[i] for i in ids]

    def reference(self) -> list[list[int]]:
        if "tokens" not in _REFERENCE:
            engine = self.engine(None)
            try:
                _REFERENCE["tokens"] = [s.token_ids[s.num_prompt_tokens:] for s in self.generate(engine)]
            finally:
                engine.shutdown()
        return _REFERENCE["tokens"]

    def started(self, case: Case) -> tuple[Any, set[int]]:
        """An engine on ``case``'s placement, and this process's children from before it started."""
        before = _children()
        tp, pp = case.config
        return self.engine(case.target, tp, pp), before

    # ------------------------------------------------------------ checks
    def test_greedy(self, case: Case) -> None:
        self.start(case)
        want = self.reference()
        engine, before = self.started(case)
        try:
            seqs = self.generate(engine)
        finally:
            engine.shutdown()
            _kill(_children() - before)
        errors = [s.error for s in seqs if s.error]
        assert not errors, f"{case.target.label} on {case.id}: requests ended with errors: {errors}"
        got = [s.token_ids[s.num_prompt_tokens:] for s in seqs]
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"{case.target.label} on {case.id}: prompt {i}'s greedy tokens {g} differ from the in-process run's {w}"

    def test_lost_rank(self, case: Case) -> None:
        import pytest

        self.start(case)
        engine, before = self.started(case)
        pids = list(engine.runner.worker_pids)
        try:
            if not pids:
                pytest.skip(f"{case.target.label} lists no process of this host (pids is empty): no rank to kill")
            rank = len(pids)  # the last rank: under pipeline parallelism the one that samples
            from corerun.sampling_params import SamplingParams

            params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
            seqs = [engine.requests[engine.add_request(p, params)] for p in _prompts()]
            engine.step()
            os.kill(pids[-1], signal.SIGKILL)
            limit = self.timeout_s + self.lost_rank_grace_s
            stepped = _run_with_limit(lambda: _drain(engine), limit)
            assert stepped, (f"{case.target.label}: the engine did not end its requests within {limit:.0f} s of rank "
                             f"{rank}'s death (distributed.timeout_s {self.timeout_s:.0f}); a lost rank must be reported")
            for s in seqs:
                assert s.is_finished and s.error, f"{case.target.label}: request {s.request_id} did not end with an error"
                assert f"rank {rank}" in s.error, f"{case.target.label}: the error does not name rank {rank}: {s.error!r}"
            late = engine.requests[engine.add_request(_prompts()[0], SamplingParams(max_tokens=2))]
            assert _run_with_limit(lambda: _drain(engine), limit) and late.error, "a request after the loss ran without an error"
            assert _run_with_limit(engine.shutdown, limit), f"{case.target.label}: shutdown() hung after a lost rank"
        finally:
            _kill(_children() - before)
            _leave_group()  # an engine whose executor hung still holds the process group: later cases need it

    def test_no_leaks(self, case: Case) -> None:
        self.start(case)
        engine, before = self.started(case)
        pids = list(engine.runner.worker_pids)
        try:
            self.generate(engine, max_tokens=2)
        finally:
            finished = _run_with_limit(engine.shutdown, 60.0)
        deadline = time.monotonic() + self.leak_grace_s
        while time.monotonic() < deadline and (not all(gone(p) for p in pids) or _children() - before - set(pids)):
            time.sleep(0.05)
        alive = [p for p in pids if not gone(p)]
        extra = sorted(p for p in _children() - before if not gone(p))
        _kill(set(alive) | set(extra))
        if not finished:
            _leave_group()
        assert finished, f"{case.target.label}: shutdown() did not return within 60 s"
        assert not alive, f"{case.target.label}: its ranks {alive} outlived shutdown() by {self.leak_grace_s:.0f} s"
        assert not extra, f"{case.target.label}: processes {extra} it started outlived shutdown() by {self.leak_grace_s:.0f} s"


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _drain(engine: Any) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _run_with_limit(fn: Any, limit_s: float) -> bool:
    """Run ``fn`` on a daemon thread; whether it returned within ``limit_s`` (an exception counts as returned)."""
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="corerun-executor-suite").start()
    return done.wait(limit_s)
