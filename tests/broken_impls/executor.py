"""Broken executors, each corerun's ``local`` executor with one fault, that ``ExecutorSuite`` must reject."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

from corerun.executor.step import Step
from corerun.sdk.executor import ExecutorCapabilities, Failure, LocalExecutor, WorkerLaunch

CAPABILITIES = ExecutorCapabilities(pipeline_parallel=False)  # tp2 only: one placement per check keeps them short


class DropsAStep(LocalExecutor):
    """The third step's message never reaches the workers (a lost write on the channel)."""

    def __init__(self) -> None:
        super().__init__()
        self._steps = 0

    def send(self, command: Any) -> None:
        if isinstance(command, Step):
            self._steps += 1
            if self._steps == 3:
                return
        super().send(command)


class HangsOnADeadRank(LocalExecutor):
    """Waits for a report from a dead rank that never comes: ``failure`` and ``quick_check`` block instead
    of naming the rank whose process ended."""

    def failure(self, grace_s: float) -> Failure | None:
        time.sleep(grace_s)
        self._drain()
        while not self.reports and any(p.exitcode is not None for p in self.procs):
            time.sleep(1.0)  # "its report must be on its way": a killed rank never sends one
            self._drain()
        return super().failure(0.0)

    def quick_check(self) -> Failure | None:
        return self.failure(0.0)


class LeaksAProcess(LocalExecutor):
    """Starts a helper process beside the ranks (a log shipper) and never stops it."""

    def start(self, launch: WorkerLaunch) -> Any:
        self.helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        return super().start(launch)
