"""The ``launched`` executor, for several hosts: every rank is launched on its host (``torchrun``, or by hand) and joins through
``distributed.init_method`` (``env://``: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; or ``tcp://HOST:PORT``).

Rank 0 is the process that runs the engine; it broadcasts each command to the other ranks over a
gloo group of its own (no timeout: workers may wait long for the next step).  Workers report
"ready" and their errors under keys of the rendezvous store, where rank 0 looks when a step fails.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from typing import Any
from datetime import timedelta

import torch.distributed as dist

from corerun.config import Config
from corerun.errors import ConfigError
from corerun.distributed.errors import (
    CommunicationError, Failure, RankFailedError, TensorParallelError, is_communication_failure, root_cause,
)
from corerun.distributed.group import TensorParallelGroup
from corerun.executor.step import Command, Shutdown
from corerun.protocols.executor import WorkerLaunch

logger = logging.getLogger("corerun.parallel")

CONTROL_TIMEOUT = timedelta(days=365)  # workers wait for rank 0's next command without limit
KEY_PREFIX = "corerun/tp/"


def launched_rank(config: Config) -> tuple[int, int]:
    """``(rank, local_rank)`` of this process from ``RANK`` / ``LOCAL_RANK`` (default 0 / rank), checked against the config."""
    size = config.tensor_parallel_size * config.pipeline_parallel_size
    world = os.environ.get("WORLD_SIZE")
    if world is not None and int(world) != size:
        raise ConfigError(
            f"WORLD_SIZE={world} in the environment, but tensor_parallel_size x pipeline_parallel_size is {size}; "
            "launch exactly that many ranks"
        )
    rank = int(os.environ.get("RANK", "0"))
    if not 0 <= rank < size:
        raise ConfigError(f"RANK={rank} is outside [0, tensor_parallel_size x pipeline_parallel_size = {size})")
    return rank, int(os.environ.get("LOCAL_RANK", str(rank)))


def join(config: Config, rank: int, local_rank: int, is_worker: bool) -> tuple[TensorParallelGroup, dist.Store, dist.ProcessGroup]:
    """Rendezvous at ``distributed.init_method``; returns ``(group, store for reports, control group)``."""
    from torch.distributed.rendezvous import rendezvous

    from corerun.distributed.process_group import backend_for, bind_device, init_group

    world = config.tensor_parallel_size * config.pipeline_parallel_size
    d = config.distributed
    device = bind_device(config, local_rank, world, is_worker)
    logger.info("tensor-parallel rank %d of %d joining at %s", rank, world, d.init_method)
    store, _, _ = next(rendezvous(d.init_method, rank, world, timeout=timedelta(seconds=d.timeout_s)))
    group = init_group(backend_for(config), store, rank, world, d.timeout_s, device)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return group, dist.PrefixStore(KEY_PREFIX, store), control


class LaunchedExecutor:
    """The ``launched`` executor: rank 0's handle on ranks started elsewhere (torchrun, by hand); commands
    by broadcast over a control group, reports and the last stage's replies through the store."""

    def __init__(self) -> None:
        self.store: dist.Store | None = None
        self.control: dist.ProcessGroup | None = None
        self.world_size = 1
        self._closed = False
        self._replies: dict[int, int] = {}  # rank -> replies collected so far

    def start(self, launch: WorkerLaunch) -> None:
        """Join the ranks at ``distributed.init_method`` as rank 0 (they are started by whoever launched
        them); creates the control group, so returns ``None``: rank 0 is in the default group already."""
        from corerun.config import Config

        config = Config.model_validate(launch.config)
        _, local_rank = launched_rank(config)
        _, self.store, self.control = join(config, 0, local_rank, is_worker=False)
        self.world_size = launch.placement.world_size
        return None

    @property
    def pids(self) -> list[int]:
        """Empty: the workers are not this process's children."""
        return []

    def send(self, cmd: Command) -> None:
        if self._closed:
            raise CommunicationError("the launched ranks were shut down")
        try:
            dist.broadcast_object_list([cmd], src=0, group=self.control)
        except RuntimeError as exc:
            raise CommunicationError(f"sending a command to the tensor-parallel workers failed: {exc}") from exc

    def _reports(self) -> list[Failure]:
        """Every rank's error report in the store (``"P|time|message"``: primary; ``"C|..."``: a broken collective)."""
        found = []
        for rank in range(1, self.world_size):
            key = f"error/{rank}"
            if self.store.check([key]):
                kind, at, message = self.store.get(key).decode().split("|", 2)
                found.append(Failure(rank, message, primary=kind == "P", at=float(at)))
        return found

    def wait_for(self, what: str, timeout_s: float) -> None:
        """Wait until every rank has set ``what/<rank>``; raise naming a rank that reported an error."""
        if what == "started":
            return  # every rank joined the rendezvous in start()
        pending = set(range(1, self.world_size))
        deadline = time.monotonic() + timeout_s
        while pending:
            found = root_cause(self._reports(), settled=True)
            if found is not None:
                raise TensorParallelError(f"tensor-parallel rank {found.rank} failed while starting: {found.message}")
            for rank in sorted(pending):
                if self.store.check([f"{what}/{rank}"]):
                    pending.discard(rank)
            if pending and time.monotonic() > deadline:
                raise TensorParallelError(
                    f"tensor-parallel rank(s) {', '.join(map(str, sorted(pending)))} did not report {what!r} "
                    f"within {timeout_s:.0f} s (distributed.start_timeout_s); see their logs"
                )
            if pending:
                time.sleep(0.05)

    def collect(self, rank: int, timeout_s: float) -> Any:
        """The next reply of ``rank`` (``reply/<rank>/<n>`` in the store); RankFailedError naming a rank that
        reported a failure, or ``rank`` when nothing came within ``timeout_s``."""
        assert self.store is not None
        n = self._replies.get(rank, 0)
        key = f"reply/{rank}/{n}"
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            found = root_cause(self._reports(), settled=True)
            if found is not None:
                raise RankFailedError(found.rank, f"tensor-parallel rank {found.rank} failed: {found.message}")
            if time.monotonic() > deadline:
                raise RankFailedError(rank, f"rank {rank} sent no step result within {timeout_s:.0f} s (distributed.timeout_s)")
            time.sleep(0.0005)
        self._replies[rank] = n + 1
        data = self.store.get(key)
        self.store.delete_key(key)
        return pickle.loads(data)

    def quick_check(self) -> None:
        """Nothing to check without a round trip per rank; failures show when a collective fails."""
        return None

    def failure(self, grace_s: float) -> Failure | None:
        """The rank to blame among those that reported (see :func:`~corerun.distributed.errors.root_cause`),
        waiting up to ``grace_s`` for one that failed on its own.  A rank that died without a report
        cannot be seen from here."""
        deadline = time.monotonic() + grace_s
        while True:
            settled = time.monotonic() >= deadline
            found = root_cause(self._reports(), settled)
            if found is not None or settled:
                return found
            time.sleep(0.05)

    def close(self, graceful: bool = True) -> None:
        if self._closed or self.control is None:
            return
        if graceful:
            try:
                self.send(Shutdown())
            except Exception as exc:  # a worker already gone: nothing to tell it
                logger.warning("could not tell the tensor-parallel workers to shut down: %s", exc)
        self._closed = True


class BroadcastSource:
    """A launched worker's command source: rank 0's broadcasts in, reports to the store out."""

    def __init__(self, store: dist.Store, control: dist.ProcessGroup, rank: int) -> None:
        self.store, self.control, self.rank = store, control, rank
        self._sent = 0  # replies sent so far

    def recv(self) -> Command:
        box: list[Command | None] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.control)
        except RuntimeError as exc:  # rank 0 is gone
            raise EOFError(f"rank 0 closed the connection: {exc}") from exc
        return box[0]  # type: ignore[return-value]

    def ready(self) -> None:
        self.store.set(f"ready/{self.rank}", "1")

    def reply(self, obj: Any) -> None:
        self.store.set(f"reply/{self.rank}/{self._sent}", pickle.dumps(obj))
        self._sent += 1

    def fail(self, message: str, primary: bool) -> None:
        self.store.set(f"error/{self.rank}", f"{'P' if primary else 'C'}|{time.time()}|{message}")


def serve_launched(config: Config) -> None:
    """Serve as launched rank ``RANK`` (not 0) until rank 0 shuts the group down."""
    from corerun.distributed.process_group import destroy_group, stage_group
    from corerun.executor.placement import placement_for
    from corerun.executor.worker import failure_message, serve

    if config.distributed.init_method is None:
        raise ConfigError(
            "a launched tensor-parallel worker needs distributed.init_method ('env://' under torchrun, or 'tcp://HOST:PORT')"
        )
    rank, local_rank = launched_rank(config)
    if rank == 0:
        raise ConfigError("RANK=0 is the engine's own rank; start the engine there (LLM(...)), not a worker")
    group, store, control = join(config, rank, local_rank, is_worker=True)
    source = BroadcastSource(store, control, rank)
    placement = placement_for(config)
    try:
        if placement.pipeline_parallel_size > 1:
            serve(config, stage_group(placement, rank, group.device), source, placement, rank)
        else:
            serve(config, group, source)
    except EOFError as exc:
        logger.warning("tensor-parallel rank %d: %s", rank, exc)
    except BaseException as exc:
        source.fail(failure_message(exc), primary=not is_communication_failure(exc))
        raise
    finally:
        destroy_group()
    logger.info("tensor-parallel rank %d: shut down", rank)
