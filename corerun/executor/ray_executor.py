"""The ``ray`` executor (``distributed.executor: ray``): ranks 1..N-1 as Ray actors, on one host or many.

``start`` attaches to a Ray cluster (``address``: ``auto`` finds a running one, as ``ray start --head``
leaves it, and starts a local one when there is none; ``local`` always starts a local one; any other
value is a cluster address, ``ray://host:10001`` or ``host:6379``), reserves a placement group of one
bundle per rank (``{"CPU": cpus_per_rank}``, plus ``{"GPU": 1}`` on CUDA), packed on as few nodes as
possible (``PACK``), and starts one actor in each bundle but the first, which is rank 0's: the engine's
own process.  Inside the actors corerun runs the same ranks as under the ``local`` executor
(:func:`corerun.executor.worker.run_rank`): the same ``torch.distributed`` group (gloo or NCCL) through
a TCPStore rank 0 opens on its node's address, the same step messages.

Words between rank 0 and the actors travel over one TCP connection per actor
(``multiprocessing.connection`` with a random key): commands out, ``("started", pid, node address)``,
``("ready",)``, ``("reply", obj)`` and ``("error", primary, time, message)`` back, the messages of the
``local`` executor's pipes.  An actor that dies closes its connection, so rank 0 learns of it at once;
Ray's own account of the death (``ray.get`` on the actor's call) names the cause when it has one.

Every host needs corerun and the model folder at the same path (or shared storage): docs/executors.md.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import deque
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Client, Connection, Listener, wait
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch.distributed as dist

from corerun.distributed.errors import Failure, RankFailedError, TensorParallelError, is_communication_failure, root_cause
from corerun.executor.step import Command, Shutdown
from corerun.protocols.executor import WorkerLaunch

logger = logging.getLogger("corerun.parallel")

STOP_GRACE_S = 5.0  # how long the actors get to leave after Shutdown before they are killed
_INSTALL = "the ray executor needs the ray package: pip install 'corerun[ray]'"


def probe() -> list[str]:
    """Why the ``ray`` executor cannot run here (empty when it can)."""
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        return [f"{_INSTALL} ({exc})"]
    return []


class RayExecutor:
    """Ranks ``1..world_size-1`` as Ray actors in a placement group (see the module docstring).

    Options (``distributed.executor_options``): ``address`` (``auto``, ``local`` or a cluster
    address), ``cpus_per_rank`` (each bundle's CPUs, default 1), ``placement_timeout_s`` (how long
    to wait for the cluster to have room for every bundle, default 60), ``namespace``.
    """

    def __init__(self, address: str = "auto", cpus_per_rank: float = 1.0, placement_timeout_s: float = 60.0,
                 namespace: str | None = None) -> None:
        reasons = probe()
        if reasons:
            from corerun.errors import PluginUnavailableError

            raise PluginUnavailableError("executor", "ray", reasons)
        self.address, self.cpus_per_rank = address, cpus_per_rank
        self.placement_timeout_s, self.namespace = placement_timeout_s, namespace
        self.world_size = 1
        self.actors: list[Any] = []
        self.calls: list[Any] = []  # each actor's run() call: done once its rank has ended
        self.conns: dict[int, Connection] = {}
        self.started: dict[int, tuple[int, str]] = {}  # rank -> (pid, node address)
        self.said: dict[int, set[str]] = {}  # rank -> the progress words it sent ("started", "ready")
        self.reports: dict[int, Failure] = {}
        self.replies: dict[int, deque[Any]] = {}
        self.group: Any = None
        self.listener: Listener | None = None
        self.node_ip = "127.0.0.1"
        self._own_cluster = False
        self._closed = False
        self._lock = threading.Lock()  # guards conns (the accepting thread adds to it)

    # ---------------------------------------------------------------- start
    def start(self, launch: WorkerLaunch) -> dist.TCPStore:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size = world = launch.placement.world_size
        self._connect(ray, world)
        self.node_ip = ray.util.get_node_ip_address()
        gpu = launch.backend == "nccl" or launch.config.get("device") == "cuda"
        bundle = {"CPU": self.cpus_per_rank, **({"GPU": 1} if gpu else {})}
        self.group = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=self.placement_timeout_s)
        if not ready:
            raise TensorParallelError(
                f"the Ray cluster did not have room for {world} bundles of {bundle} within {self.placement_timeout_s:g} s "
                f"(distributed.executor_options.placement_timeout_s); its free resources: {ray.available_resources()}")
        self._check_rank0_bundle(ray)
        store = dist.TCPStore(self.node_ip, 0, world, is_master=True, timeout=timedelta(seconds=launch.timeout_s),
                              wait_for_workers=False)
        launch = replace(launch, store_host=self.node_ip, store_port=store.port)
        key = secrets.token_bytes(32)
        self.listener = Listener((self.node_ip, 0), authkey=key)
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True, name="corerun-ray-accept").start()
        actor_class = ray.remote(_RankActor)
        for rank in range(1, world):
            actor = actor_class.options(
                num_cpus=self.cpus_per_rank, num_gpus=1 if gpu else 0, name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank),
            ).remote()
            self.actors.append(actor)
            self.calls.append(actor.run.remote(launch, rank, self.listener.address, key, gpu))
            self.replies[rank] = deque()
        return store

    def _connect(self, ray: Any, world: int) -> None:
        if ray.is_initialized():
            return
        kwargs: dict[str, Any] = {"namespace": self.namespace, "log_to_driver": True}
        if self.address not in ("auto", "local"):
            ray.init(address=self.address, **kwargs)
            return
        if self.address == "auto":
            try:
                ray.init(address="auto", **kwargs)
                return
            except ConnectionError:
                logger.info("no running Ray cluster found: starting a local one")
        # a local cluster: its workers import corerun from where this process does
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        ray.init(num_cpus=max(os.cpu_count() or 1, int(world * self.cpus_per_rank + 0.999)), include_dashboard=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}}, **kwargs)
        self._own_cluster = True

    def _check_rank0_bundle(self, ray: Any) -> None:
        """Warn when Ray reserved rank 0's bundle on another node than the engine's: rank 0 runs here anyway,
        so this node's devices are then used beyond what Ray knows of."""
        try:
            where = ray.util.placement_group_table(self.group)["bundles_to_node_id"][0]
            here = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 (an older Ray without the table: nothing to check)
            return
        if where != here:
            logger.warning("Ray placed bundle 0 (rank 0's) on node %s, but rank 0 is this process, on node %s: run "
                           "the engine on a node with room for one bundle, or this node's devices are oversubscribed",
                           where, here)

    def _accept(self, listener: Listener) -> None:
        while True:
            try:
                conn = listener.accept()
                rank = conn.recv()  # the first word of an actor is its rank
            except OSError:  # closed: the executor is closing
                return
            except Exception:  # noqa: BLE001 (a stranger without the key: refused, keep listening)
                logger.warning("refused a connection to the Ray executor's listener", exc_info=True)
                continue
            with self._lock:
                self.conns[rank] = conn
            if len(self.conns) == self.world_size - 1:
                return

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks whose actors run on this host, in rank order."""
        return [pid for rank, (pid, ip) in sorted(self.started.items()) if ip == self.node_ip]

    # ---------------------------------------------------------------- startup
    def wait_for(self, what: str, timeout_s: float) -> None:
        """Until every actor has sent ``(what,)``; TensorParallelError naming a rank that failed or stayed silent."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._drain()
            pending = {r for r in range(1, self.world_size) if what not in self.said.get(r, ())}
            if not pending:
                return
            found = root_cause(self._failures(), settled=True)
            if found is not None:
                raise TensorParallelError(f"rank {found.rank} (a Ray actor) failed while starting: {found.message}")
            remaining = deadline - time.monotonic()
            if pending and remaining <= 0:
                raise TensorParallelError(
                    f"rank(s) {', '.join(map(str, sorted(pending)))} (Ray actors) did not report {what!r} within "
                    f"{timeout_s:.0f} s (distributed.start_timeout_s); their output is in the Ray logs")
            self._wait(min(remaining, 0.5))

    # ------------------------------------------------------------------ steps
    def send(self, cmd: Command) -> None:
        payload = ForkingPickler.dumps(cmd)  # pickled once for every actor
        for rank in range(1, self.world_size):
            conn = self.conns.get(rank)
            if conn is None:
                raise EOFError(f"rank {rank} (a Ray actor) never connected")
            conn.send_bytes(payload)

    def collect(self, rank: int, timeout_s: float) -> Any:
        """The next reply of ``rank``; RankFailedError naming a rank that failed or died, or ``rank`` when
        nothing came within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.replies[rank]:
            self._drain()
            if self.replies[rank]:
                break
            found = root_cause(self._failures(), settled=True)
            if found is not None:
                raise RankFailedError(found.rank, f"rank {found.rank} (a Ray actor) failed: {found.message}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankFailedError(rank, f"rank {rank} sent no step result within {timeout_s:.0f} s (distributed.timeout_s)")
            self._wait(min(remaining, 1.0))
        return self.replies[rank].popleft()

    def quick_check(self) -> Failure | None:
        return self.failure(0.0)

    def failure(self, grace_s: float) -> Failure | None:
        """The rank to blame, waiting up to ``grace_s`` for one that failed on its own when only broken
        collectives have been reported."""
        deadline = time.monotonic() + grace_s
        while True:
            self._drain()
            remaining = deadline - time.monotonic()
            found = root_cause(self._failures(), settled=remaining <= 0)
            if found is not None or remaining <= 0:
                return found
            self._wait(remaining)

    # ---------------------------------------------------------------- internals
    def _drain(self) -> None:
        """Read every message waiting: reports kept, replies queued, progress words noted; a connection
        that closed without a report is an actor that died."""
        with self._lock:
            conns = list(self.conns.items())
        for rank, conn in conns:
            while rank not in self.reports:
                try:
                    if not conn.poll():
                        break
                    msg = conn.recv()
                except (EOFError, OSError):
                    self.reports[rank] = Failure(rank, self._death(rank), primary=True)
                    break
                if msg[0] == "error":  # ("error", primary, time, message)
                    self.reports[rank] = Failure(rank, msg[3], primary=msg[1], at=msg[2])
                elif msg[0] == "reply":
                    self.replies[rank].append(msg[1])
                else:  # ("started", pid, node address) or ("ready",)
                    if msg[0] == "started":
                        self.started[rank] = (msg[1], msg[2])
                    self.said.setdefault(rank, set()).add(msg[0])

    def _failures(self) -> list[Failure]:
        """The reports, and actors whose call ended before they connected (Ray could not start them; asked
        of Ray only until every actor has connected: after that a closed connection tells)."""
        failures = list(self.reports.values())
        if self.calls and len(self.conns) < len(self.calls):
            import ray

            finished, _ = ray.wait(list(self.calls), num_returns=len(self.calls), timeout=0)
            for rank, call in enumerate(self.calls, start=1):
                if call in finished and rank not in self.reports and rank not in self.conns:
                    failures.append(Failure(rank, self._death(rank), primary=True))
        return failures

    def _death(self, rank: int) -> str:
        """How rank's actor ended, as Ray tells it (waiting a moment for Ray to know)."""
        import ray

        call = self.calls[rank - 1]
        try:
            ray.get(call, timeout=2.0)
        except ray.exceptions.GetTimeoutError:
            return "its Ray actor closed the connection (Ray has not said why)"
        except Exception as exc:  # noqa: BLE001 (RayActorError, RayTaskError: the cause)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"its Ray actor died: {type(exc).__name__}: {first}"
        return "its Ray actor returned"

    def _wait(self, timeout: float) -> None:
        with self._lock:
            conns = list(self.conns.values())
        if conns:
            wait(conns, timeout)
        else:
            time.sleep(min(timeout, 0.05))

    # --------------------------------------------------------------- shutdown
    def close(self, graceful: bool = True) -> None:
        """Stop every actor (``Shutdown`` first when ``graceful``), kill what is left, free the placement
        group, stop a cluster this executor started. Safe twice."""
        if self._closed:
            return
        self._closed = True
        import ray

        if graceful:
            for conn in list(self.conns.values()):
                try:
                    conn.send(Shutdown())
                except (OSError, ValueError):
                    pass
            if self.calls:
                ray.wait(list(self.calls), num_returns=len(self.calls), timeout=STOP_GRACE_S)
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 (already gone)
                pass
        for conn in self.conns.values():
            conn.close()
        if self.listener is not None:
            self.listener.close()
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.group)
            except Exception:  # noqa: BLE001 (the cluster is gone)
                pass
        if self._own_cluster:
            ray.shutdown()
        self._wait_gone()

    def _wait_gone(self, timeout_s: float = 10.0) -> None:
        """Until the actors' processes on this host have exited (a killed actor's worker ends a moment later)."""
        deadline = time.monotonic() + timeout_s
        for pid in self.pids:
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:
                    break
                time.sleep(0.05)


class _RankActor:
    """One rank inside a Ray actor: connect back to rank 0, then run the rank until rank 0 shuts down."""

    def run(self, launch: WorkerLaunch, rank: int, address: Any, key: bytes, gpu: bool) -> None:
        import ray

        from corerun.executor.local import PipeSource
        from corerun.executor.worker import failure_message, run_rank

        conn = Client(address, authkey=key)
        conn.send(rank)
        conn.send(("started", os.getpid(), ray.util.get_node_ip_address()))
        source = PipeSource(conn)
        try:
            run_rank(launch, rank, source, local_rank=0 if gpu else None)  # (Ray shows each actor its own GPU)
        except EOFError:
            pass  # rank 0 closed the connection: nothing left to do
        except BaseException as exc:
            source.fail(failure_message(exc), primary=not is_communication_failure(exc))
            raise
        finally:
            conn.close()
