"""``TensorParallelRunner``: rank 0 of a placement, a ModelRunner whose steps the other ranks mirror.

Rank 0 does everything a ModelRunner does (it schedules nothing itself: the engine does, against
rank 0's KV-cache manager).  Each step's :class:`ScheduledBatch` message goes to ranks 1..N-1 as it
is (plain values, with the tokens rank 0 sampled since its last command); every rank applies it to
its own persistent batch, builds its own step inputs and runs the same forward.  ``_compute_logits``
tells the workers which rows of their hidden states to project, so that every rank takes part in
the vocabulary gather.  Only rank 0 samples.  The KV cache's block count is agreed inside
ModelRunner's construction (the smallest rank's), before any rank allocates it.

Under pipeline parallelism (:mod:`corerun.executor.stage`) rank 0 runs stage 0 only: it passes its
hidden states to the next stage and collects the step's result from the last stage through the
executor, then records the sampled tokens as if it had sampled them.

A rank that fails mid-step takes the group down (the others may be waiting in a collective that
will never complete): the step's requests end with :class:`RankFailedError` ("tensor-parallel rank 1
failed: ..."), the workers are stopped, and every later step fails with the same message.  Errors
outside the collectives (a sampler refusing a request) leave the group running.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import numpy as np
import torch

from corerun.config import Config
from corerun.core.batch import ScheduledBatch, StepResult
from corerun.distributed.errors import Failure, RankFailedError, TensorParallelError, is_communication_failure
from corerun.distributed.group import TensorParallelGroup
from corerun.errors import StepError
from corerun.executor.stage import StageRunner
from corerun.executor.step import CompareBatch, Logits, Recorded, Step, StepFailed, Timeline, Vocabulary
from corerun.protocols.executor import Placement, WorkerLaunch
from corerun.runner.model_runner import ExecuteModelState, PreparedStep
from corerun.protocols.attention import AttentionBatch
from corerun.protocols.graph import ModelInputs
from corerun.plugin.registry import Registry

logger = logging.getLogger("corerun.parallel")

FAILURE_GRACE_S = 2.0  # after a failed collective, how long to wait for a worker's report or exit


class TensorParallelRunner(StageRunner):
    """Rank 0 of a placement of ``tensor_parallel_size x pipeline_parallel_size`` ranks; the same attributes
    and ``execute`` as :class:`ModelRunner`.

    The other ranks are started and driven by ``executor`` (``distributed.executor``; see
    :mod:`corerun.protocols.executor`): ``local`` starts them as child processes, ``launched`` joins
    ranks started by torchrun or by hand.  Call :meth:`shutdown` (``llm.engine.shutdown()``) to stop the
    workers; they also stop when this object is collected, at interpreter exit, and when this process dies.

    With one stage rank 0 runs the whole model and samples; with several it runs stage 0, passes its
    hidden states on and collects each step's result from the last stage (``executor.collect``).
    """

    def __init__(self, config: Config, registry: Registry | None = None, placement: Placement | None = None,
                 executor: Any = None) -> None:
        from corerun.distributed.process_group import (
            backend_for, bind_device, device_type, ensure_not_initialized, init_group, stage_group,
        )
        from corerun.executor.placement import placement_for
        from corerun.executor.select import make_executor

        placement = placement or placement_for(config)
        self._check_model(config, placement.tensor_parallel_size)  # before any process starts
        if executor is None:
            executor = make_executor(config, placement, registry)[1]
        n, timeout = placement.world_size, config.distributed.timeout_s
        start_timeout = config.distributed.start_timeout_s or timeout
        ensure_not_initialized()
        self._busy = False  # True while the workers may be waiting in a collective for rank 0
        self._recorded: Recorded = {}  # tokens sampled since the workers' last command (seq_id -> tokens)
        self._broken: RankFailedError | None = None
        self.workers: Any = executor
        self._joined = True  # this object joins (and so must leave) the default process group
        self._finalizer: weakref.finalize | None = weakref.finalize(self, _release, executor, True, True)
        try:
            backend = backend_for(config)
            store = executor.start(WorkerLaunch(config.model_dump(), placement, backend, timeout))
            executor.wait_for("started", start_timeout)
            if store is not None:
                device = bind_device(config, 0, n, is_worker=False)
                init_group(backend, store, 0, n, timeout, device)
            else:  # the executor joined rank 0 itself
                device = torch.device("cuda", torch.cuda.current_device()) if device_type(config) == "cuda" else torch.device("cpu")
            world = TensorParallelGroup(0, n, device)
            pipelined = placement.pipeline_parallel_size > 1
            group = stage_group(placement, 0, device) if pipelined else world
            self.tp = world  # every rank: the ranks' persistent batches are gathered over it
            super().__init__(config, registry, group, placement, 0, world if pipelined else None)
            executor.wait_for("ready", start_timeout)
        except BaseException as exc:
            found = self._startup_failure(exc)
            self.shutdown(graceful=False)
            if found is not None:
                raise TensorParallelError(f"tensor-parallel rank {found.rank} failed while starting: {found.message}") from exc
            raise
        logger.info("placement: %d x %d ranks on executor %s, workers %s", placement.tensor_parallel_size,
                    placement.pipeline_parallel_size, type(executor).__name__, self.worker_pids)

    @staticmethod
    def _check_model(config: Config, tp: int) -> None:
        """The model's heads and features split over the ranks, read from the folder the runner loads
        (a ``.gguf`` file's folder is written here once, before the workers would race to write it)."""
        from corerun.distributed.sharding import check_model
        from corerun.models.config import ModelConfig
        from corerun.runner.construction import model_dir_for

        check_model(ModelConfig.from_model_dir(model_dir_for(config)), tp)

    def _startup_failure(self, exc: BaseException) -> Failure | None:
        """The worker to blame when a collective of rank 0's construction broke (a worker failed while building)."""
        if self.workers is None or not is_communication_failure(exc):
            return None
        return self.workers.failure(FAILURE_GRACE_S)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 on this host (empty when they were launched elsewhere)."""
        return [] if self.workers is None else self.workers.pids

    # ------------------------------------------------------------------ step
    def prepare_step(self, sched: ScheduledBatch, eos_token_ids: frozenset[int]) -> PreparedStep:
        """The message goes to the workers first, with the tokens rank 0 sampled since its last command;
        every rank then applies both to its own persistent batch and builds its own step inputs."""
        self._busy = True  # from here the workers wait in the step's collectives for rank 0
        recorded, self._recorded = self._recorded, {}
        self.workers.send(Step(sched, recorded))
        return super().prepare_step(sched, eos_token_ids)

    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Once rank 0's forward returns, every rank of its stage has left the step's collectives."""
        hidden = super()._forward(inputs)
        self._busy = self.pipelined  # the later stages are still at work
        return hidden

    def _compute_logits(self, hidden: torch.Tensor, rows: slice | np.ndarray, batch: AttentionBatch) -> torch.Tensor:
        """The workers are told which rows of their own hidden states to project onto their vocabulary
        ranges (every rank holds the same hidden states); rank 0 gathers the slices."""
        self._busy = True
        self.workers.send(Logits(rows))
        logits = super()._compute_logits(hidden, rows, batch)
        self._busy = False
        return logits

    def sample_tokens(self, state: ExecuteModelState) -> StepResult:
        """Rank 0 samples alone; the tokens it records in its persistent batch go to the workers with
        the next command, before that command's message, as rank 0 applied them."""
        result = super().sample_tokens(state)
        req_ids = state.step.sched.req_ids
        self._recorded = {req_ids[i]: tuple(result.emitted(j)) for j, i in enumerate(state.step.rows.tolist())}
        return result

    def set_vocabulary(self, tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        """Pipeline parallel: the last stage samples, so its logits processors get the tokenizer too (pickled once)."""
        super().set_vocabulary(tokenizer, eos_token_ids)
        if self.pipelined:
            self.workers.send(Vocabulary(tokenizer, eos_token_ids))

    def _launch_stages(self, sched: ScheduledBatch, eos_token_ids: frozenset[int]) -> None:
        """Every stage applies the message; rank 0 runs stage 0 and passes its hidden states on."""
        self._busy = True
        recorded, self._recorded = self._recorded, {}
        self.workers.send(Step(sched, recorded, eos_token_ids))
        inputs, _, _ = self.prepare_inputs(sched)
        self.receive(0)  # (stage 0: nothing to receive; its work starts now)
        with torch.no_grad():
            self.pass_on(self._forward(inputs))
        self.worked()

    def _collect_stages(self, sched: ScheduledBatch) -> StepResult:
        """The last stage sampled; its result comes back through the executor.  Rank 0 records the tokens in its
        own batch, and sends them to the stages before the last with the next command."""
        self._busy = True
        reply = self.workers.collect(self.placement.last_stage_rank, self.config.distributed.timeout_s)
        self._busy = False
        if isinstance(reply, StepFailed):
            raise StepError(reply.message)
        result: StepResult = reply
        index, req_ids = self.input_batch.index, sched.req_ids
        for j, i in enumerate(result.rows):
            row = index.get(req_ids[i])  # (None: ended by a message applied since this micro-batch was launched)
            if row is not None:
                self.input_batch.record(row, result.emitted(j))
                self._recorded[req_ids[i]] = tuple(result.emitted(j))
        return result

    def batch_snapshots(self) -> list[dict[int, Any]]:
        """Every rank's persistent batch (:meth:`InputBatch.snapshot`), rank 0's first: equal when the ranks
        agree.  Between steps only; the workers first take the tokens rank 0 recorded since its last step."""
        self._check_up()
        recorded, self._recorded = self._recorded, {}
        return self._gather(CompareBatch(recorded), lambda: self.input_batch.snapshot())

    def stage_timelines(self) -> list[list[tuple[float, float]]]:
        """Every rank's stage work intervals (``(start, end)``, wall clock), rank 0's first; between steps only."""
        self._check_up()
        return self._gather(Timeline(), lambda: list(self.timeline))

    def _gather(self, cmd: Any, mine: Any) -> list[Any]:
        """Send ``cmd``, whose answer every worker gives by ``gather_object``; rank 0's own is ``mine()``."""
        self._busy = True
        try:
            self.workers.send(cmd)
            out = self.tp.gather_object(mine())
        except BaseException as exc:
            failure = self._diagnose(exc)
            self._go_down(failure)
            if isinstance(exc, Exception):
                raise failure from exc
            raise
        self._busy = False
        return out

    def _check_up(self) -> None:
        """Raise RankFailedError when the group is down (or a worker is seen gone now)."""
        if self._broken is None and self.workers is not None:
            found = self.workers.quick_check()
            if found is not None:
                self._go_down(_rank_failed(found))
        if self._broken is not None:
            raise RankFailedError(self._broken.rank, f"{self._broken} (the tensor-parallel group is down; create a new LLM)")

    def execute(self, sched: ScheduledBatch, eos_token_ids: frozenset[int]) -> StepResult:
        if self.pipelined:
            self.launch(sched, eos_token_ids)
            return self.collect(sched)
        return self._guarded(super().execute, sched, eos_token_ids)

    def launch(self, sched: ScheduledBatch, eos_token_ids: frozenset[int]) -> None:
        """Pipeline parallel: start a micro-batch (every rank takes the message, rank 0 runs stage 0 and passes
        its hidden states on) without waiting for its result; :meth:`collect` takes results in launch order."""
        self._guarded(self._launch_stages, sched, eos_token_ids)

    def collect(self, sched: ScheduledBatch) -> StepResult:
        """The result of the oldest micro-batch launched (``sched``), from the last stage."""
        return self._guarded(self._collect_stages, sched)

    def _guarded(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` with the group checked first; a failure inside the collectives takes the group down."""
        self._check_up()
        try:
            return fn(*args)
        except BaseException as exc:
            if not self._busy:
                raise  # outside the collectives (e.g. the sampler): the workers are waiting for the next command
            if isinstance(exc, RankFailedError):  # the executor's collect named the rank
                self._go_down(exc)
                raise
            failure = self._diagnose(exc)
            self._go_down(failure)
            if isinstance(exc, Exception):
                raise failure from exc
            raise

    def _diagnose(self, exc: BaseException) -> RankFailedError:
        """Which rank to blame for ``exc``, raised on rank 0 in the middle of a step."""
        link_broke = is_communication_failure(exc)  # then another rank failed first: wait for its news
        found = self.workers.failure(FAILURE_GRACE_S if link_broke else 0.0) if self.workers is not None else None
        if found is not None and (found.primary or link_broke):
            return _rank_failed(found)
        if isinstance(exc, KeyboardInterrupt):
            return RankFailedError(0, "tensor-parallel rank 0 was interrupted in the middle of a step")
        if link_broke:
            return RankFailedError(
                None, f"a tensor-parallel collective failed and no rank reported why (a rank on another host may have died): {exc}"
            )
        return RankFailedError(0, f"tensor-parallel rank 0 failed: {exc}")

    def _go_down(self, failure: RankFailedError) -> None:
        logger.error("%s; stopping the tensor-parallel group", failure)
        self._broken = failure
        self.shutdown(graceful=False)

    # -------------------------------------------------------------- shutdown
    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers (graceful: ask first) and leave the process group. Safe to call twice."""
        if self._finalizer is not None:
            self._finalizer.detach()
        workers, self.workers = self.workers, None
        joined, self._joined = self._joined, False
        _release(workers, graceful, joined)
        super().shutdown()


def _rank_failed(found: Failure) -> RankFailedError:
    return RankFailedError(found.rank, f"tensor-parallel rank {found.rank} failed: {found.message}")


def _release(workers: Any, graceful: bool, leave_group: bool) -> None:
    from corerun.distributed.process_group import destroy_group

    if workers is not None:
        workers.close(graceful)
    if leave_group:
        destroy_group()

