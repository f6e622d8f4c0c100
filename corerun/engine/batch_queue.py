"""Asynchronous scheduling: a one-deep batch queue.

While step N runs on the step thread (the forward, then sampling: torch releases the GIL inside its
kernels), the engine schedules step N+1 from placeholder counts (``Scheduler.set_in_flight``).  The
queue holds at most one step; :meth:`BatchQueue.take` waits for it.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from corerun.core.batch import ScheduledBatch, StepResult
from corerun.errors import ConfigError, StepError


class BatchQueue:
    """At most one prepared step running on a thread of its own (made on first use)."""

    def __init__(self, runner: Any) -> None:
        self._runner = weakref.ref(runner)  # (once the step is done, the step thread holds nothing of the engine)
        self._cuda_index = _cuda_index(runner.device)
        self._threads = runner.threads
        self._thread: ThreadPoolExecutor | None = None
        self.in_flight: tuple[ScheduledBatch, Future] | None = None

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
