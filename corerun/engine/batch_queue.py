"""The engine's overlapping steps: asynchronous scheduling's one-deep batch queue, and pipeline parallelism's
micro-batches.

While step N runs on the step thread (the forward, then sampling: torch releases the GIL inside its
kernels), the engine schedules step N+1 from placeholder counts (``Scheduler.set_in_flight``).  The
queue holds at most one step; :meth:`BatchQueue.take` waits for it.  :func:`step_async` and
:func:`step_stages` are ``LLMEngine.step`` in those two modes; each applies results through the
engine's ``update`` and its failure paths, as the synchronous step does.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from corerun.core.batch import ScheduledBatch, StepResult
from corerun.core.scheduler import SchedulingError
from corerun.errors import ConfigError, StepError


class BatchQueue:
    """At most one prepared step running on a thread of its own (made on first use)."""

    def __init__(self, runner: Any) -> None:
        self._runner = weakref.ref(runner)  # (once the step is done, the step thread holds nothing of the engine)
        self._cuda_index = _cuda_index(runner.device)
        self._threads = runner.threads
        self._thread: ThreadPoolExecutor | None = None
        self.in_flight: tuple[ScheduledBatch, Future] | None = None
        self.collected: list[Any] = []  # sequences whose step was collected outside step() (an abort, shutdown)
        self.unsent: ScheduledBatch | None = None  # an emptied batch: what it tells the runner goes with the next one

    def launch(self, batch: ScheduledBatch, prepared: Any) -> None:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, "corerun-step", initializer=_init_step_thread,
                                              initargs=(self._cuda_index, self._threads))
        self.in_flight = (batch, self._thread.submit(_run_step, self._runner, prepared))

    def take(self) -> tuple[ScheduledBatch, StepResult | BaseException] | None:
        """Wait for the step in flight: ``(batch, result or the exception it raised)``; None when there is none."""
        step, self.in_flight = self.in_flight, None
        if step is None:
            return None
        batch, future = step
        try:
            return batch, future.result()
        except Exception as exc:
            return batch, exc

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)


def step_stages(engine: Any) -> list[Any]:
    """``LLMEngine.step`` with pipeline parallelism: keep up to one micro-batch per stage in flight, each of
    requests the others do not hold (``Scheduler.busy``), launched as it is scheduled; then take the oldest
    one's result."""
    touched: list[Any] = []
    while len(engine.stages) < engine.runner.pipeline_depth:
        try:
            batch = engine.scheduler.schedule()
        except SchedulingError as exc:
            touched += engine.scheduling_failed(exc)
            break
        if not batch:
            if not engine.stages:
                touched += engine.unschedulable(batch)
            break
        engine.num_steps += 1
        try:
            engine.runner.launch(batch, engine.eos_token_ids)
        except Exception as exc:
            touched += engine.step_failed(batch, exc)
            break
        engine.scheduler.busy.update(batch.req_ids)
        engine.stages.append(batch)
    if not engine.stages:
        return touched
    batch = engine.stages.popleft()
    engine.scheduler.busy.difference_update(batch.req_ids)
    try:
        result = engine.runner.collect(batch)
    except Exception as exc:
        return touched + engine.step_failed(batch, exc)
    return touched + engine.update(batch, result)


def step_async(engine: Any) -> list[Any]:
    """``LLMEngine.step`` with asynchronous scheduling: schedule step N+1 while step N runs on the step
    thread; then take N's tokens, drop from N+1
    the requests N ended (nothing of theirs run or emitted) and launch N+1.  Returns what N touched
    (what a synchronous step N returns)."""
    touched, engine.queue.collected = [s for s in engine.queue.collected if s.finish_reason != "abort"], []
    had_in_flight = engine.queue.in_flight is not None
    try:
        batch = engine.scheduler.schedule()
    except SchedulingError as exc:
        return touched + collect(engine) + engine.scheduling_failed(exc)
    touched += collect(engine)
    batch = engine.scheduler.settle(batch)  # (rows scheduled from placeholder counts, now that N's result is in)
    if not batch:
        return touched if had_in_flight else touched + engine.unschedulable(batch)
    keep = [i for i, s in enumerate(engine.scheduler.seqs_of(batch)) if s is not None and not s.is_finished]
    if len(keep) < len(batch.req_ids):  # ended by step N: never run, never emitted
        batch = batch.only(keep)
        if not batch:  # nothing left to launch: what the batch tells the runner goes with the next one
            engine.queue.unsent = batch if engine.queue.unsent is None else batch.telling(engine.queue.unsent)
            return touched
    if engine.queue.unsent is not None:
        batch, engine.queue.unsent = batch.telling(engine.queue.unsent), None
    engine.num_steps += 1
    try:
        prepared = engine.runner.prepare_step(batch, engine.eos_token_ids)
    except Exception as exc:
        return touched + engine.step_failed(batch, exc)
    engine.scheduler.set_in_flight(batch)
    engine.queue.launch(batch, prepared)
    return touched


def collect(engine: Any) -> list[Any]:
    """Wait for the step in flight (if any) and apply its result, as a synchronous step would."""
    taken = engine.queue.take()
    if taken is None:
        return []
    batch, result = taken
    if isinstance(result, BaseException):
        engine.scheduler.clear_in_flight()
        return engine.step_failed(batch, result)
    return engine.update(batch, result)


def check_async_scheduling(config: Any) -> bool:
    """``scheduler.async_scheduling``, refused with tensor parallelism (its workers run the step in step)."""
    if not config.scheduler.async_scheduling:
        return False
    if config.tensor_parallel_size > 1:
        raise ConfigError(
            f"scheduler.async_scheduling: true runs on one device only (tensor_parallel_size is "
            f"{config.tensor_parallel_size}); use tensor_parallel_size: 1 or async_scheduling: false"
        )
    return True


def _cuda_index(device: Any) -> int | None:
    """The CUDA device index the engine's thread runs on (``cuda`` without an index: its current one); None off CUDA."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return device.index if device.index is not None else torch.cuda.current_device()


def _init_step_thread(cuda_index: int | None, threads: int) -> None:
    """The step thread runs with the engine thread's CUDA device and intra-op thread count."""
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if cuda_index is not None:  # (the current device is per thread)
        torch.cuda.set_device(cuda_index)


def _run_step(runner_ref: Any, prepared: Any) -> StepResult:
    runner = runner_ref()
    if runner is None:  # (the engine went away meanwhile: nobody waits for this step)
        raise StepError("the engine was shut down before its step ran")
    return runner.sample_tokens(runner.execute_model(prepared))
