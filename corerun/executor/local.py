"""The ``local`` executor: on one host, rank 0 spawns ranks 1..N-1 and sends them commands over pipes.

Rendezvous is a TCPStore rank 0 opens on a free port of 127.0.0.1.  Workers are daemon processes
(``torch.multiprocessing``; ``distributed.start_method``: spawn, or forkserver, whose server imports
torch once for every later worker) that ignore Ctrl-C (rank 0 decides), watch a lifeline pipe whose
other end only rank 0 holds (its death ends them at once) and report their errors on the command
pipe before they exit.  Rank 0 learns of a failure from
the report or from the process's exit status; under NCCL a monitor thread also aborts the process
group when a worker dies, so that rank 0 is not left waiting in a collective.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback
import time
import weakref
from collections import deque
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch.distributed as dist

from corerun.distributed.errors import Failure, RankFailedError, TensorParallelError, is_communication_failure, root_cause
from corerun.executor.step import Command, Shutdown
from corerun.protocols.executor import WorkerLaunch

logger = logging.getLogger("corerun.parallel")

STOP_GRACE_S = 5.0  # how long a worker gets to leave after Shutdown before it is terminated


def describe_exit(code: int | None) -> str:
    if code is None:
        return "its process is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"its process was killed by signal {name}"
    return f"its process exited with code {code}"


class LocalExecutor:
    """The ``local`` executor: ranks ``1..world_size-1`` as child processes of this host (see the module docstring)."""

    def __init__(self, start_method: str | None = None) -> None:
        self.start_method = start_method  # None: distributed.start_method
        self.procs: list[Any] = []
        self.conns: list[Connection] = []  # commands out; ("started",), ("ready",), ("reply", obj), ("error", ...) back
        self.lifelines: list[Connection] = []  # never written; closing (or dying) tells the worker to exit
        self.reports: dict[int, Failure] = {}  # rank -> its error report
        self.replies: dict[int, deque[Any]] = {}  # rank -> replies not collected yet
        self.world_size = 1
        self._monitor: _DeathMonitor | None = None
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self.lifelines, True)

    def start(self, launch: WorkerLaunch) -> dist.TCPStore:
        import torch.multiprocessing as mp

        method = self.start_method or launch.config["distributed"]["start_method"]
        self.world_size = world_size = launch.placement.world_size
        timeout = timedelta(seconds=launch.timeout_s)
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        launch = replace(launch, store_host="127.0.0.1", store_port=store.port)
        ctx = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(["corerun.executor.local", "corerun.executor.worker", "corerun.runner.model_runner"])
        for rank in range(1, world_size):
            mine, theirs = ctx.Pipe(duplex=True)
            life_r, life_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, args=(launch, rank, theirs, life_r),
                               name=f"corerun-tp-rank-{rank}", daemon=True)
            self.conns.append(mine)
            self.lifelines.append(life_w)
            proc.start()
            self.procs.append(proc)
            theirs.close()
            life_r.close()
            self.replies[rank] = deque()
        self._monitor = _DeathMonitor(self.procs) if launch.backend == "nccl" else None
        return store

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1, in rank order."""
        return [p.pid for p in self.procs]

    # ---------------------------------------------------------------- startup
    def wait_for(self, what: str, timeout_s: float) -> None:
        """Wait until every worker has sent ``(what,)``; raise TensorParallelError naming the rank that failed."""
        pending = set(range(1, self.world_size))
        deadline = time.monotonic() + timeout_s
        while pending:
            exits = self._exit_codes()  # before reading the pipes: a worker reports, then exits
            self._drain(what, pending)
            found = self._root_cause(exits, settled=True)
            if found is not None:
                raise TensorParallelError(f"tensor-parallel rank {found.rank} failed while starting: {found.message}")
            remaining = deadline - time.monotonic()
            if pending and remaining <= 0:
                raise TensorParallelError(
                    f"tensor-parallel rank(s) {', '.join(map(str, sorted(pending)))} did not report {what!r} within "
                    f"{timeout_s:.0f} s (distributed.start_timeout_s); see their output above"
                )
            if pending:
                wait([self.conns[r - 1] for r in pending] + [self.procs[r - 1].sentinel for r in pending], min(remaining, 1.0))

    def _drain(self, what: str | None = None, pending: set[int] | None = None) -> None:
        """Read every message waiting on the pipes: error reports are kept, ``(what,)`` clears ``pending``."""
        for rank, conn in enumerate(self.conns, start=1):
            while rank not in self.reports and conn.poll():
                msg = _recv(conn)
                if msg is None:
                    break
                if msg[0] == "error":  # ("error", primary, time, message)
                    self.reports[rank] = Failure(rank, msg[3], primary=msg[1], at=msg[2])
                elif msg[0] == "reply":
                    self.replies[rank].append(msg[1])
                elif msg[0] == what and pending is not None:
                    pending.discard(rank)

    def _exit_codes(self) -> list[int | None]:
        return [proc.exitcode for proc in self.procs]  # each polls waitpid

    def _root_cause(self, exits: list[int | None], settled: bool) -> Failure | None:
        """Blame from the reports, and from the exits seen *before* the pipes were last read (a worker
        always reports before it exits, so an exit seen then without a report had none to make)."""
        failures = list(self.reports.values())
        for rank, code in enumerate(exits, start=1):
            if rank not in self.reports and code is not None:
                failures.append(Failure(rank, describe_exit(code), primary=True))
        return root_cause(failures, settled)

    # ------------------------------------------------------------------ steps
    def quick_check(self) -> Failure | None:
        """A worker that has exited or reported an error, without waiting (a few system calls)."""
        return self.failure(0.0)

    def send(self, cmd: Command) -> None:
        payload = ForkingPickler.dumps(cmd)  # pickled once for every worker; they read it with recv()
        for conn in self.conns:
            conn.send_bytes(payload)

    def collect(self, rank: int, timeout_s: float) -> Any:
        """The next reply of ``rank``; RankFailedError naming a rank that failed or exited, or ``rank``
        when nothing came within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.replies[rank]:
            exits = self._exit_codes()
            self._drain()
            if self.replies[rank]:
                break
            found = self._root_cause(exits, settled=True)
            if found is not None:
                raise RankFailedError(found.rank, f"tensor-parallel rank {found.rank} failed: {found.message}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankFailedError(rank, f"rank {rank} sent no step result within {timeout_s:.0f} s (distributed.timeout_s)")
            wait(self.conns + [p.sentinel for p in self.procs], min(remaining, 1.0))
        return self.replies[rank].popleft()

    def failure(self, grace_s: float) -> Failure | None:
        """The worker to blame (see :func:`~corerun.distributed.errors.root_cause`), waiting up to ``grace_s``
        for a worker that failed on its own to show, when only broken collectives have been reported."""
        deadline = time.monotonic() + grace_s
        while True:
            exits = self._exit_codes()
            self._drain()
            remaining = deadline - time.monotonic()
            found = self._root_cause(exits, settled=remaining <= 0)
            if found is not None or remaining <= 0:
                return found
            quiet = [r for r, code in enumerate(exits, start=1) if code is None and r not in self.reports]
            if not quiet:
                return self._root_cause(exits, settled=True)
            wait([self.conns[r - 1] for r in quiet] + [self.procs[r - 1].sentinel for r in quiet], remaining)

    # --------------------------------------------------------------- shutdown
    def close(self, graceful: bool = True) -> None:
        """Stop every worker (``Shutdown`` first when ``graceful``, then terminate, then kill) and reap it."""
        if self._monitor is not None:
            self._monitor.stop()
        if graceful:
            self._finalizer()
        else:
            self._finalizer.detach()
            _stop(self.procs, self.conns, self.lifelines, False)


def _recv(conn: Connection) -> tuple[str, ...] | None:
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def _stop(procs: list[Any], conns: list[Connection], lifelines: list[Connection], graceful: bool) -> None:
    """Stop ``procs`` (``Shutdown`` first when ``graceful``, then terminate, then kill), reap them, close the pipes."""
    if graceful:
        for conn in conns:
            try:
                conn.send(Shutdown())
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns + lifelines:
        conn.close()


class _DeathMonitor:
    """Aborts the NCCL process group as soon as a worker dies, so rank 0 does not wait out the collective timeout."""

    def __init__(self, procs: list[Any]) -> None:
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._run, args=([p.sentinel for p in procs],), daemon=True,
                                        name="corerun-tp-monitor")
        self._thread.start()

    def _run(self, sentinels: list[int]) -> None:
        ready = wait(sentinels + [self._stop_r])
        if self._stop_r in ready:
            return
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None and dist.is_initialized():
            logger.error("a tensor-parallel worker died; aborting the NCCL process group")
            abort()

    def stop(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join(1.0)
        os.close(self._stop_w)
        os.close(self._stop_r)


# ------------------------------------------------------------------ worker side
class PipeSource:
    """A worker's end of its pipe: commands in; ``("started",)``, ``("ready",)``, ``("reply", obj)``,
    ``("error", primary, time, message)`` out."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def recv(self) -> Command:
        return self.conn.recv()  # EOFError when rank 0 is gone

    def ready(self) -> None:
        self.conn.send(("ready",))

    def reply(self, obj: Any) -> None:
        self.conn.send(("reply", obj))

    def fail(self, message: str, primary: bool) -> None:
        try:
            self.conn.send(("error", primary, time.time(), message))
        except OSError:
            pass


def _watch_lifeline(lifeline: Connection) -> None:
    """Exit at once when rank 0 closes the lifeline or its process ends (killed, crashed, gone without shutdown)."""

    def run() -> None:
        wait([lifeline])  # readable only at EOF: nobody writes to it
        os._exit(1)

    threading.Thread(target=run, daemon=True, name="corerun-lifeline").start()


def worker_main(launch: WorkerLaunch, rank: int, conn: Connection, lifeline: Connection) -> None:
    """A spawned worker: report started, then :func:`corerun.executor.worker.run_rank` until rank 0 shuts down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_lifeline(lifeline)
    source = PipeSource(conn)
    code = 0
    try:
        from corerun.executor.worker import run_rank

        conn.send(("started",))
        run_rank(launch, rank, source)
    except EOFError:
        code = 0  # rank 0 closed the pipe: nothing left to do
    except BaseException as exc:
        from corerun.executor.worker import failure_message

        traceback.print_exc()
        source.fail(failure_message(exc), primary=not is_communication_failure(exc))
        code = 1
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
