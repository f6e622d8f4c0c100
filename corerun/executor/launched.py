"""Several hosts: every rank is launched on its host (``torchrun``, or by hand) and joins through
``distributed.init_method`` (``env://``: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; or ``tcp://HOST:PORT``).

Rank 0 is the process that runs the engine; it broadcasts each command to the other ranks over a
gloo group of its own (no timeout: workers may wait long for the next step).  Workers report
"ready" and their errors under keys of the rendezvous store, where rank 0 looks when a step fails.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import torch.distributed as dist

from corerun.config import Config
from corerun.errors import ConfigError
from corerun.distributed.errors import CommunicationError, Failure, TensorParallelError, is_communication_failure, root_cause
from corerun.distributed.group import TensorParallelGroup
from corerun.executor.step import Command, Shutdown

logger = logging.getLogger("corerun.parallel")

CONTROL_TIMEOUT = timedelta(days=365)  # workers wait for rank 0's next command without limit
KEY_PREFIX = "corerun/tp/"


def launched_rank(config: Config) -> tuple[int, int]:
    """``(rank, local_rank)`` of this process from ``RANK`` / ``LOCAL_RANK`` (default 0 / rank), checked against the config."""
    world = os.environ.get("WORLD_SIZE")
    if world is not None and int(world) != config.tensor_parallel_size:
        raise ConfigError(
            f"WORLD_SIZE={world} in the environment, but tensor_parallel_size is {config.tensor_parallel_size}; "
            "launch exactly tensor_parallel_size ranks"
        )
    rank = int(os.environ.get("RANK", "0"))
    if not 0 <= rank < config.tensor_parallel_size:
        raise ConfigError(f"RANK={rank} is outside [0, tensor_parallel_size={config.tensor_parallel_size})")
    return rank, int(os.environ.get("LOCAL_RANK", str(rank)))


def join(config: Config, rank: int, local_rank: int, is_worker: bool) -> tuple[TensorParallelGroup, dist.Store, dist.ProcessGroup]:
    """Rendezvous at ``distributed.init_method``; returns ``(group, store for reports, control group)``."""
    from torch.distributed.rendezvous import rendezvous

    from corerun.distributed.process_group import backend_for, bind_device, init_group

    world = config.tensor_parallel_size
    d = config.distributed
    device = bind_device(config, local_rank, world, is_worker)
    logger.info("tensor-parallel rank %d of %d joining at %s", rank, world, d.init_method)
    store, _, _ = next(rendezvous(d.init_method, rank, world, timeout=timedelta(seconds=d.timeout_s)))
    group = init_group(backend_for(config), store, rank, world, d.timeout_s, device)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return group, dist.PrefixStore(KEY_PREFIX, store), control


class LaunchedWorkers:
    """Rank 0's handle on ranks launched elsewhere: commands by broadcast, reports from the store."""

    def __init__(self, store: dist.Store, control: dist.ProcessGroup, world_size: int) -> None:
        self.store, self.control, self.world_size = store, control, world_size
        self._closed = False

    @property
    def pids(self) -> list[int]:
        """Empty: the workers are not this process's children."""
        return []

    def send(self, cmd: Command) -> None:
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
                    f"within {timeout_s:.0f} s (distributed.timeout_s); see their logs"
                )
            if pending:
                time.sleep(0.05)

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
        if self._closed:
            return
        self._closed = True
        if graceful:
            try:
                self.send(Shutdown())
            except Exception as exc:  # a worker already gone: nothing to tell it
                logger.warning("could not tell the tensor-parallel workers to shut down: %s", exc)


class BroadcastSource:
    """A launched worker's command source: rank 0's broadcasts in, reports to the store out."""

    def __init__(self, store: dist.Store, control: dist.ProcessGroup, rank: int) -> None:
        self.store, self.control, self.rank = store, control, rank

    def recv(self) -> Command:
        box: list[Command | None] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.control)
        except RuntimeError as exc:  # rank 0 is gone
            raise EOFError(f"rank 0 closed the connection: {exc}") from exc
        return box[0]  # type: ignore[return-value]

    def ready(self) -> None:
        self.store.set(f"ready/{self.rank}", "1")

    def fail(self, message: str, primary: bool) -> None:
        self.store.set(f"error/{self.rank}", f"{'P' if primary else 'C'}|{time.time()}|{message}")


def serve_launched(config: Config) -> None:
    """Serve as launched rank ``RANK`` (not 0) until rank 0 shuts the group down."""
    from corerun.distributed.process_group import destroy_group
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
    try:
        serve(config, group, source)
    except EOFError as exc:
        logger.warning("tensor-parallel rank %d: %s", rank, exc)
    except BaseException as exc:
        source.fail(failure_message(exc), primary=not is_communication_failure(exc))
        raise
    finally:
        destroy_group()
    logger.info("tensor-parallel rank %d: shut down", rank)
