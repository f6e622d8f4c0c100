"""What an executor plugin builds on (docs/executors.md): the protocol's types, the errors it raises,
the entry point every rank it starts runs, and corerun's ``local`` executor as a base class.

- :class:`Executor`, :class:`CommandSource`, :class:`Placement`, :class:`WorkerLaunch`, :class:`Failure`
  (``corerun.protocols.executor``);
- :class:`RankFailedError` (``collect`` found a rank lost), :class:`TensorParallelError` (``wait_for``:
  a rank failed while starting), :class:`CommunicationError` (``send`` could not reach a rank),
  :func:`root_cause` (which of several failures to blame) and :func:`describe_exit` (a process's exit code
  in words);
- :func:`run_rank`: what each started rank runs, ``run_rank(launch, rank, source, local_rank)``;
- :class:`LocalExecutor`: ranks as child processes over pipes (override ``start`` to place them elsewhere).
"""

from __future__ import annotations

from corerun.distributed.errors import CommunicationError, TensorParallelError, is_communication_failure, root_cause
from corerun.executor.local import LocalExecutor, describe_exit
from corerun.executor.step import Shutdown
from corerun.executor.worker import failure_message, run_rank
from corerun.plugin.capabilities import ExecutorCapabilities
from corerun.protocols.executor import CommandSource, Executor, Failure, Placement, RankFailedError, WorkerLaunch

__all__ = [
    "CommandSource", "CommunicationError", "Executor", "ExecutorCapabilities", "Failure", "LocalExecutor", "Placement",
    "RankFailedError", "Shutdown", "TensorParallelError", "WorkerLaunch", "describe_exit", "failure_message",
    "is_communication_failure", "root_cause", "run_rank",
]
