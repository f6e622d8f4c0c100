"""The ``inproc`` executor: one rank, the engine's own process; nothing to start, send or collect."""

from __future__ import annotations

from typing import Any

from corerun.errors import ConfigError
from corerun.protocols.executor import Failure, WorkerLaunch


class InProcExecutor:
    """World size 1: the engine runs a plain ModelRunner and this executor starts nothing."""

    def start(self, launch: WorkerLaunch) -> None:
        if launch.placement.world_size != 1:
            raise ConfigError(
                f"distributed.executor 'inproc' runs one rank; tensor_parallel_size x pipeline_parallel_size is "
                f"{launch.placement.world_size}: use distributed.executor: local (or auto)"
            )
        return None

    def wait_for(self, what: str, timeout_s: float) -> None:
        return None

    def send(self, command: Any) -> None:
        raise ConfigError("the in-process executor has no other rank to send to")

    def collect(self, rank: int, timeout_s: float) -> Any:
        raise ConfigError("the in-process executor has no other rank to collect from")

    def failure(self, grace_s: float) -> Failure | None:
        return None

    def quick_check(self) -> Failure | None:
        return None

    def close(self, graceful: bool = True) -> None:
        return None

    @property
    def pids(self) -> list[int]:
        return []
