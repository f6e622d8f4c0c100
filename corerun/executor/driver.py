"""``TensorParallelRunner``: rank 0 of a tensor-parallel group, a ModelRunner whose steps the workers mirror.

Rank 0 does everything a ModelRunner does (it schedules nothing itself: the engine does, against
rank 0's KV-cache manager).  Each step's :class:`ScheduledBatch` message goes to ranks 1..N-1 as it
is (plain values, with the tokens rank 0 sampled since its last command); every rank applies it to
its own persistent batch, builds its own step inputs and runs the same forward.  ``_compute_logits``
tells the workers which rows of their hidden states to project, so that every rank takes part in
the vocabulary gather.  Only rank 0 samples.  The KV cache's block count is agreed inside
ModelRunner's construction (the smallest rank's), before any rank allocates it.

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
from corerun.runner.model_runner import ExecuteModelState, ModelRunner, PreparedStep
from corerun.distributed.errors import Failure, RankFailedError, TensorParallelError, is_communication_failure
from corerun.executor.step import CompareBatch, Logits, Recorded, Step
from corerun.protocols.attention import AttentionBatch
from corerun.protocols.graph import ModelInputs
from corerun.plugin.registry import Registry

logger = logging.getLogger("corerun.parallel")

FAILURE_GRACE_S = 2.0  # after a failed collective, how long to wait for a worker's report or exit


class TensorParallelRunner(ModelRunner):
    """Rank 0 of ``config.tensor_parallel_size`` ranks; the same attributes and ``execute`` as :class:`ModelRunner`.

    One host (``distributed.init_method`` unset): starts ranks 1..N-1 as child processes.  Launched
    (``env://`` / ``tcp://``): joins ranks started by torchrun or by hand; on a rank other than 0 it
    serves rank 0 until shutdown and then exits the process (``SystemExit(0)``).
    Call :meth:`shutdown` (``llm.engine.shutdown()``) to stop the workers; they also stop when this
    object is collected, at interpreter exit, and when this process dies.
    """

    def __init__(self, config: Config, registry: Registry | None = None) -> None:
        from corerun.executor.launched import LaunchedWorkers, join, launched_rank, serve_launched
        from corerun.executor.local import LocalWorkers
        from corerun.distributed.process_group import (
            backend_for, bind_device, ensure_not_initialized, init_group,
        )

        n, dcfg = config.tensor_parallel_size, config.distributed
        if dcfg.init_method is not None:
            rank, local_rank = launched_rank(config)
            if rank != 0:
                serve_launched(config)
                raise SystemExit(0)
        self._check_model(config)  # before any process starts
        ensure_not_initialized()
        self._busy = False  # True while the workers may be waiting in a collective for rank 0
        self._recorded: Recorded = {}  # tokens sampled since the workers' last command (seq_id -> tokens)
        self._broken: RankFailedError | None = None
        self.workers: Any = None
        self._joined = False  # this object joined (and so must leave) the default process group
        self._finalizer: weakref.finalize | None = None
        try:
            if dcfg.init_method is not None:
                group, store, control = join(config, 0, local_rank, is_worker=False)
                self.workers = LaunchedWorkers(store, control, n)
            else:
                backend = backend_for(config)
                device = bind_device(config, 0, n, is_worker=False)
                self.workers = LocalWorkers(config, n, backend)
                self.workers.wait_for("started", dcfg.timeout_s)
                group = init_group(backend, self.workers.store, 0, n, dcfg.timeout_s, device)
            self._joined = True
            self._finalizer = weakref.finalize(self, _release, self.workers, True, True)
            self.tp = group
            super().__init__(config, registry, tp=group)  # with the workers' collectives (the KV block count)
            self.workers.wait_for("ready", dcfg.timeout_s)
        except BaseException as exc:
            found = self._startup_failure(exc)
            self.shutdown(graceful=False)
            if found is not None:
                raise TensorParallelError(f"tensor-parallel rank {found.rank} failed while starting: {found.message}") from exc
            raise
        logger.info("tensor parallel: %d ranks, %s", n, "launched" if dcfg.init_method else f"workers {self.worker_pids}")

    @staticmethod
    def _check_model(config: Config) -> None:
        """The model's heads and features split over the ranks, read from the folder the runner loads
        (a ``.gguf`` file's folder is written here once, before the workers would race to write it)."""
        from corerun.distributed.sharding import check_model
        from corerun.models.config import ModelConfig
        from corerun.runner.construction import model_dir_for

        check_model(ModelConfig.from_model_dir(model_dir_for(config)), config.tensor_parallel_size)

    def _startup_failure(self, exc: BaseException) -> Failure | None:
        """The worker to blame when a collective of rank 0's construction broke (a worker failed while building)."""
        if self.workers is None or not is_communication_failure(exc):
            return None
        return self.workers.failure(FAILURE_GRACE_S)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 on this host (empty when they were launched elsewhere)."""
        return [] if self.workers is None else self.workers.pids

    def describe(self) -> dict[str, str]:
        return {**super().describe(), "tensor_parallel_size": str(self.config.tensor_parallel_size)}

    # ------------------------------------------------------------------ step
    def prepare_step(self, sched: ScheduledBatch, eos_token_ids: frozenset[int]) -> PreparedStep:
        """The message goes to the workers first, with the tokens rank 0 sampled since its last command;
        every rank then applies both to its own persistent batch and builds its own step inputs."""
        self._busy = True  # from here the workers wait in the step's collectives for rank 0
        recorded, self._recorded = self._recorded, {}
        self.workers.send(Step(sched, recorded))
        return super().prepare_step(sched, eos_token_ids)

    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Once rank 0's forward returns, every rank has left the step's collectives."""
        hidden = super()._forward(inputs)
        self._busy = False
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

    def batch_snapshots(self) -> list[dict[int, Any]]:
        """Every rank's persistent batch (:meth:`InputBatch.snapshot`), rank 0's first: equal when the ranks
        agree.  Between steps only; the workers first take the tokens rank 0 recorded since its last step."""
        self._check_up()
        recorded, self._recorded = self._recorded, {}
        self._busy = True
        try:
            self.workers.send(CompareBatch(recorded))
            snaps = self.tp.gather_object(self.input_batch.snapshot())
        except BaseException as exc:
            failure = self._diagnose(exc)
            self._go_down(failure)
            if isinstance(exc, Exception):
                raise failure from exc
            raise
        self._busy = False
        return snaps

    def _check_up(self) -> None:
        """Raise RankFailedError when the group is down (or a worker is seen gone now)."""
        if self._broken is None and self.workers is not None:
            found = self.workers.quick_check()
            if found is not None:
                self._go_down(_rank_failed(found))
        if self._broken is not None:
            raise RankFailedError(self._broken.rank, f"{self._broken} (the tensor-parallel group is down; create a new LLM)")

    def execute(self, sched: ScheduledBatch, eos_token_ids: frozenset[int]) -> StepResult:
        self._check_up()
        try:
            return super().execute(sched, eos_token_ids)
        except BaseException as exc:
            if not self._busy:
                raise  # outside the collectives (e.g. the sampler): the workers are waiting for the next command
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

