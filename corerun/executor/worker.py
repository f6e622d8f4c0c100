"""The worker loop: ranks 1..N-1 build their model shard and run rank 0's commands.

Launched by hand (or by a tool other than torchrun) on another host::

    RANK=1 WORLD_SIZE=2 MASTER_ADDR=host0 MASTER_PORT=29500 \\
        python -m corerun.executor.worker --config tp.yaml

with ``distributed: {init_method: "env://"}`` in ``tp.yaml`` (the file rank 0 uses too).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Protocol

import torch

from corerun.config import Config
from corerun.distributed.errors import TensorParallelError
from corerun.distributed.group import TensorParallelGroup
from corerun.executor.step import Command, CompareBatch, Logits, Recorded, Shutdown, Step
from corerun.runner.input_batch import InputBatch

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

    A step is rank 0's message: the worker records the tokens rank 0 sampled since its last command,
    applies the message to its own persistent batch (exactly the changes rank 0's batch went through,
    in the same order), builds its step inputs from it and runs the same forward; it keeps the
    step's hidden states for the logits rank 0 asks for.  A failure raises :class:`TensorParallelError`
    whose message names the stage and the error (the caller reports it to rank 0 through
    ``source.fail``); ``EOFError`` means rank 0 closed the channel.
    """
    from corerun.runner.model_runner import ModelRunner

    stage = "starting (building the model shard, attention backend and KV cache)"
    try:
        runner = ModelRunner(config, tp=group)  # agrees on the KV block count with the other ranks before allocating
        source.ready()
        batch = runner.input_batch
        hidden: torch.Tensor | None = None
        step: Any = None  # the current step's AttentionBatch
        while True:
            stage = "reading rank 0's commands"
            cmd = source.recv()
            if isinstance(cmd, Step):
                stage = "applying the step's message to the persistent batch"
                hidden = None
                _record(batch, cmd.recorded)
                inputs, _, _ = runner.prepare_inputs(cmd.batch)
                stage = "running the model forward"
                hidden, step = runner.graph.run(inputs), inputs.batch
            elif isinstance(cmd, Logits):
                stage = "computing logits"
                if hidden is None:
                    raise TensorParallelError("rank 0 asked for logits, but no step's hidden states are held")
                with torch.no_grad():
                    runner.model.compute_logits(runner.hidden_rows(hidden, cmd.rows, step))
            elif isinstance(cmd, CompareBatch):
                stage = "sending the persistent batch to rank 0"
                _record(batch, cmd.recorded)
                group.gather_object(batch.snapshot())
            elif isinstance(cmd, Shutdown):
                return
            else:
                raise TensorParallelError(f"unknown command {cmd!r} from rank 0")
    except (EOFError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:
        raise TensorParallelError(f"{stage}: {type(exc).__name__}: {exc}") from exc


def _record(batch: InputBatch, recorded: Recorded) -> None:
    """The tokens rank 0 recorded after sampling (its ``InputBatch.record``), into this rank's batch."""
    for seq_id, tokens in recorded.items():
        row = batch.index.get(seq_id)
        if row is None:
            raise TensorParallelError(f"rank 0 recorded tokens for request {seq_id}, which this rank's batch does not hold")
        batch.record(row, list(tokens))


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
