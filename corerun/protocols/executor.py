"""The ``Executor`` protocol: how the ranks of a placement are started, fed each step and stopped.

A placement is ``tensor_parallel_size x pipeline_parallel_size`` ranks.  Rank ``r`` is tensor-parallel
rank ``r % tp`` of pipeline stage ``r // tp``; stage ``s`` holds the contiguous decoder layers
``Placement.stage_layers[s]``.  **Rank 0 is the engine's own process** (stage 0, tensor-parallel rank
0): the executor never starts it.  Every rank (rank 0 included) runs corerun's own code: it joins
torch.distributed's default process group through the store :meth:`Executor.start` returns, builds
its model shard, KV cache and persistent batch, and applies each step's message as rank 0 did.  An
executor only decides *where the other ranks run and how words reach them*:

1. ``start(launch) -> store | None``: open the rendezvous store (a ``torch.distributed.TCPStore``
   master on a host and port every rank can reach) and start ranks ``1 .. world_size - 1``
   (processes, Ray actors, pods...), each running :func:`corerun.executor.worker.run_rank`
   ``(launch, rank, source, local_rank)`` with ``launch`` carrying the store's address
   (``dataclasses.replace(launch, store_host=..., store_port=...)``), ``source`` the executor's
   :class:`CommandSource` for that rank and ``local_rank`` the device index it binds (``None``:
   ``rank``).  Returns rank 0's end of the store; corerun then joins the default process group as
   rank 0 and builds its own stage.  ``None``: ``start`` joined rank 0 to the group itself (the
   launched executor does, to create a control group of its own right after).  Returns promptly:
   readiness is ``wait_for``'s job.
2. ``wait_for(what, timeout_s)``: block until every started rank has reported ``what`` (``"started"``:
   its process is up, before it joins the group; ``"ready"``: its model and KV cache are built).  A
   rank that reported an error or whose process ended raises
   :class:`~corerun.distributed.errors.TensorParallelError` naming the rank; a rank silent past
   ``timeout_s`` raises it naming the ranks still pending.  corerun passes
   ``distributed.start_timeout_s`` here (``timeout_s`` when that is unset).
3. ``send(command)``: hand one command to every started rank, in order (the same object, pickled
   once; commands are small plain dataclasses of ``corerun.executor.step``: ``Step`` carries the
   scheduler's frozen ``ScheduledBatch`` message).  Returns without waiting for the ranks to run it.
   Raises ``CommunicationError`` (or ``OSError`` / ``EOFError``) when a rank can no longer be reached.
4. ``collect(rank, timeout_s)``: the next reply of ``rank`` (what its source's ``reply(obj)`` sent):
   under pipeline parallelism the last stage's first rank replies to each ``Step`` with the step's
   :class:`~corerun.core.batch.StepResult`.  Replies from one rank arrive in the order it sent them.
   Raises ``RankFailedError`` naming the rank when that rank (or any other) has failed or
   exited, and when nothing arrives within ``timeout_s`` (it never waits longer).
5. ``failure(grace_s) -> Failure | None``: the rank to blame after a step failed, waiting up to
   ``grace_s`` for a rank that failed on its own to show (a rank whose collective broke reports
   ``primary=False``; :func:`~corerun.distributed.errors.root_cause` picks).  ``quick_check()`` is the
   same with no wait, called before every step: a few system calls, no round trip.
6. ``close(graceful)``: stop every rank (``graceful``: send ``Shutdown`` first and give them a few
   seconds; then terminate, then kill) and reap them; nothing the executor started outlives it.
   Safe to call twice, and after any failure.
7. ``pids``: process ids of the started ranks on this host, in rank order (empty when they run
   elsewhere); the conformance suite checks each is gone after ``close``.

The worker side of a rank is a :class:`CommandSource`: ``recv()`` the next command (``EOFError`` once
rank 0 is gone), ``ready()``, ``reply(obj)`` (to rank 0's ``collect``), ``fail(message, primary)``.

A rank lost mid-step surfaces on rank 0 as :class:`RankFailedError`
(``"tensor-parallel rank 1 failed: its process was killed by signal SIGKILL"``) within
``distributed.timeout_s`` at most; the engine ends that step's requests with it, later steps fail
with the same message, and ``shutdown()`` still stops every rank.

Capabilities (``corerun.plugin.capabilities.ExecutorCapabilities``, plain data registered with the
executor) say which placements it can start (``max_world_size``, ``pipeline_parallel``), whether
its ranks may run on other hosts (``multi_host``) and whether it is async-safe (``async_safe``:
``send`` / ``collect`` may run on the engine's step thread while ``quick_check`` runs on another).
An executor is registered through the ``corerun_executors`` hook (``register(name, factory,
capabilities=ExecutorCapabilities(...))``) and built as ``factory(**options)`` with
``distributed.executor_options``, once per engine, before ``start``.  Placements with one stage
never call ``collect`` (rank 0 samples); with several, rank 0 calls it once per step.
The executors corerun ships (``distributed.executor``): ``inproc`` (one rank, no process),
``local`` (ranks as child processes on this host, over pipes), ``launched`` (ranks started by
torchrun or by hand, joined through ``distributed.init_method``); ``auto`` picks ``inproc`` for one
rank, ``launched`` when ``init_method`` is set, else ``local``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from corerun.errors import StepError

if TYPE_CHECKING:
    import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Placement:
    """``tensor_parallel_size x pipeline_parallel_size`` ranks; stage ``s`` holds layers ``stage_layers[s]``
    (``(start, end)``, contiguous, covering ``[0, num_layers)`` in order)."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    stage_layers: tuple[tuple[int, int], ...]

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def stage_of(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    def ranks_of_stage(self, stage: int) -> list[int]:
        tp = self.tensor_parallel_size
        return list(range(stage * tp, (stage + 1) * tp))

    @property
    def last_stage_rank(self) -> int:
        """The rank that samples and replies with each step's result (the last stage's tensor-parallel rank 0)."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    @classmethod
    def of(cls, tp: int, pp: int, num_layers: int, pipeline_layers: list[int] | None = None) -> "Placement":
        """Stages from ``pipeline_layers`` (layers per stage, summing to ``num_layers``), or computed:
        ``num_layers // pp`` each, the first ``num_layers % pp`` stages one more.  Raises ValueError
        naming the field, its value and what would fit."""
        if pp > num_layers:
            raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's {num_layers} layers; use at most {num_layers}")
        if pipeline_layers is None:
            base, extra = divmod(num_layers, pp)
            pipeline_layers = [base + (s < extra) for s in range(pp)]
        elif len(pipeline_layers) != pp or sum(pipeline_layers) != num_layers or min(pipeline_layers) < 1:
            raise ValueError(
                f"distributed.pipeline_layers {list(pipeline_layers)} must give {pp} stages (pipeline_parallel_size) "
                f"at least one layer each, summing to the model's {num_layers} layers"
            )
        bounds, start = [], 0
        for n in pipeline_layers:
            bounds.append((start, start + n))
            start += n
        return cls(tp, pp, tuple(bounds))


@dataclass(frozen=True, slots=True)
class WorkerLaunch:
    """What every rank is started with: plain values, picklable, the same for every rank.

    ``config``: the engine's configuration (``Config.model_dump()``); ``backend``: ``"gloo"`` or ``"nccl"``;
    ``store_host`` / ``store_port``: where rank 0's store listens (``start`` fills them in for the
    ranks it starts, ``0`` before); ``timeout_s``: ``distributed.timeout_s``.
    """

    config: dict[str, Any]
    placement: Placement
    backend: str
    timeout_s: float
    store_host: str = "127.0.0.1"
    store_port: int = 0


@dataclass(frozen=True, slots=True)
class Failure:
    """What rank 0 learned about a failed rank.

    ``primary``: the rank failed on its own (an error it reported, or its process ended without a
    report, e.g. killed); ``False`` when it reported a broken collective, the consequence of another
    rank's failure.  ``at``: when it reported (``time.time()``), ``None`` for an unreported exit.
    """

    rank: int
    message: str
    primary: bool
    at: float | None = None


class RankFailedError(StepError):
    """A rank failed or was lost during a step; the group is down and every later step fails with the same message.

    ``rank`` is the rank that failed (``None`` when no rank could be named).
    """

    def __init__(self, rank: int | None, message: str) -> None:
        self.rank = rank
        super().__init__(message)


@runtime_checkable
class CommandSource(Protocol):
    """A started rank's end of the executor's channel (handed to ``run_rank``)."""

    def recv(self) -> Any:
        """The next command from rank 0, blocking; ``EOFError`` when rank 0 is gone."""

    def ready(self) -> None:
        """This rank has built its model shard and KV cache (rank 0's ``wait_for("ready")``)."""

    def reply(self, obj: Any) -> None:
        """Send ``obj`` (picklable) to rank 0's ``collect(rank)``."""

    def fail(self, message: str, primary: bool) -> None:
        """Report this rank's failure; ``primary``: it failed on its own, not because a collective broke."""


@runtime_checkable
class Executor(Protocol):
    """Starts and drives ranks ``1 .. world_size - 1`` of a :class:`Placement` (see the module docstring)."""

    def start(self, launch: WorkerLaunch) -> "dist.Store | None": ...

    def wait_for(self, what: Literal["started", "ready"], timeout_s: float) -> None: ...

    def send(self, command: Any) -> None: ...

    def collect(self, rank: int, timeout_s: float) -> Any: ...

    def failure(self, grace_s: float) -> Failure | None: ...

    def quick_check(self) -> Failure | None: ...

    def close(self, graceful: bool = True) -> None: ...

    @property
    def pids(self) -> list[int]: ...


__all__ = [
    "CommandSource", "Executor", "Failure", "Placement", "RankFailedError", "WorkerLaunch",
]
