"""The worker loop: ranks 1..N-1 build their model shard and run rank 0's commands.

Launched by hand (or by a tool other than torchrun) on another host::

    RANK=1 WORLD_SIZE=2 MASTER_ADDR=host0 MASTER_PORT=29500 \\
        python -m corerun.executor.worker --config tp.yaml

with ``distributed: {init_method: "env://"}`` in ``tp.yaml`` (the file rank 0 uses too).
"""

from __future__ import annotations

import argparse
import logging
from typing import Protocol

import torch

from corerun.config import Config
from corerun.distributed.errors import TensorParallelError
from corerun.distributed.group import TensorParallelGroup
from corerun.executor.step import Command, LogitsHeader, Shutdown, StepHeader, unpack_step

logger = logging.getLogger("corerun.parallel")


class CommandSource(Protocol):
    """Where a worker gets rank 0's commands, and how it tells rank 0 it is ready or has failed."""

    def recv(self) -> Command:
        """The next command; ``EOFError`` when rank 0 is gone."""

    def ready(self) -> None:
        """This rank has built its model shard."""

    def fail(self, message: str, primary: bool) -> None:
        """``primary``: this rank failed on its own, not because a collective broke under it."""


def serve(config: Config, group: TensorParallelGroup, source: CommandSource) -> None:
    """Build this rank's ModelRunner, then run rank 0's commands until :class:`Shutdown`.

    A failure raises :class:`TensorParallelError` whose message names the stage and the error (the
    caller reports it to rank 0 through ``source.fail``); ``EOFError`` means rank 0 closed the channel.
    """
    from corerun.runner.model_runner import ModelRunner

    stage = "starting (building the model shard, attention backend and KV cache)"
    try:
        runner = ModelRunner(config, tp=group)  # agrees on the KV block count with the other ranks before allocating
        source.ready()
        hidden_size, dtype, device = runner.model_config.hidden_size, runner.dtype, runner.device
        while True:
            stage = "reading rank 0's commands"
            cmd = source.recv()
            if isinstance(cmd, StepHeader):
                stage = "running the model forward"
                packed = group.broadcast(torch.empty(cmd.packed_size, dtype=torch.int64, device=device))
                runner.graph.run(unpack_step(cmd, packed))
            elif isinstance(cmd, LogitsHeader):
                stage = "computing logits"
                hidden = group.broadcast(torch.empty(cmd.num_rows, hidden_size, dtype=dtype, device=device))
                with torch.no_grad():
                    runner.model.compute_logits(hidden)
            elif isinstance(cmd, Shutdown):
                return
            else:
                raise TensorParallelError(f"unknown command {cmd!r} from rank 0")
    except (EOFError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:
        raise TensorParallelError(f"{stage}: {type(exc).__name__}: {exc}") from exc


def failure_message(exc: BaseException) -> str:
    """What a worker reports to rank 0 for ``exc``."""
    return str(exc) if isinstance(exc, TensorParallelError) else f"{type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> None:
    """``python -m corerun.executor.worker --config tp.yaml [--set KEY=VALUE ...]``: serve one launched rank."""
    from corerun.config import load_config
    from corerun.executor.launched import serve_launched

    parser = argparse.ArgumentParser(prog="python -m corerun.executor.worker", description=main.__doc__)
    parser.add_argument("--config", required=True, help="the YAML configuration rank 0 uses")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = load_config(args.config, sets=args.sets)
    serve_launched(config)


if __name__ == "__main__":
    main()
