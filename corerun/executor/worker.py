"""The worker loop: ranks 1..N-1 build their model shard and run rank 0's commands.

Launched by hand (or by a tool other than torchrun) on another host::

    RANK=1 WORLD_SIZE=2 MASTER_ADDR=host0 MASTER_PORT=29500 \\
        python -m corerun.executor.worker --config tp.yaml

with ``distributed: {init_method: "env://"}`` in ``tp.yaml`` (the file rank 0 uses too).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import torch

from corerun.config import Config
from corerun.distributed.errors import TensorParallelError, is_communication_failure
from corerun.distributed.group import TensorParallelGroup
from corerun.errors import StepError
from corerun.executor.step import CompareBatch, Logits, Recorded, Shutdown, Step, StepFailed, Timeline, Vocabulary
from corerun.protocols.executor import CommandSource, Placement, WorkerLaunch
from corerun.runner.input_batch import InputBatch

logger = logging.getLogger("corerun.parallel")


def serve(config: Config, group: TensorParallelGroup | None, source: CommandSource,
          placement: Placement | None = None, rank: int | None = None) -> None:
    """Build this rank's runner, then run rank 0's commands until :class:`Shutdown`.

    ``group``: this rank's tensor-parallel group (its stage's under pipeline parallelism, ``None`` for a
    stage of one rank); ``placement`` / ``rank``: where this rank sits (``None``: one stage, the group's
    rank).  A step is rank 0's message: the worker records the tokens rank 0 sampled since its last
    command, applies the message to its own persistent batch (exactly the changes rank 0's batch went
    through, in the same order), builds its step inputs from it and runs the same forward; it keeps the
    step's hidden states for the logits rank 0 asks for.  A pipeline stage receives its input from the
    stage before and passes its output on; the last stage samples, records its own tokens and its
    first rank replies with the step's result.  A failure raises :class:`TensorParallelError` whose
    message names the stage and the error (the caller reports it to rank 0 through ``source.fail``);
    ``EOFError`` means rank 0 closed the channel.
    """
    from corerun.executor.stage import StageRunner

    if placement is None:  # one stage: the group is every rank
        assert group is not None
        placement, rank = Placement(group.world_size, 1, ((0, 0),)), group.rank
    assert rank is not None
    world = TensorParallelGroup(rank, placement.world_size, _device(config))  # every rank, every stage
    stage = "starting (building the model shard, attention backend and KV cache)"
    try:
        runner = StageRunner(config, None, group, placement, rank, world if placement.pipeline_parallel_size > 1 else None)
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
                if runner.pipelined:
                    _pipeline_step(runner, cmd, source, placement, rank)
                    continue
                _record(batch, cmd.recorded)
                inputs, _, _ = runner.prepare_inputs(cmd.batch)
                if runner.lora is not None:  # (as ModelRunner.execute_model does on rank 0)
                    runner.lora.begin_step(cmd.batch.new_reqs, inputs.lora_slots)
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
                if not runner.is_last or not runner.pipelined:
                    _record(batch, cmd.recorded)
                world.gather_object(batch.snapshot())
            elif isinstance(cmd, Vocabulary):
                runner.set_vocabulary(cmd.tokenizer, cmd.eos_token_ids)
            elif isinstance(cmd, Timeline):
                stage = "sending the stage timeline to rank 0"
                world.gather_object(list(runner.timeline))
            elif isinstance(cmd, Shutdown):
                return
            else:
                raise TensorParallelError(f"unknown command {cmd!r} from rank 0")
    except (EOFError, KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:
        raise TensorParallelError(f"{stage}: {type(exc).__name__}: {exc}") from exc


def _pipeline_step(runner: Any, cmd: Step, source: CommandSource, placement: Placement, rank: int) -> None:
    """One step on a stage other than rank 0's: receive, run this stage's layers, pass on or sample."""
    if not runner.is_last:
        _record(runner.input_batch, cmd.recorded)
        inputs, _, _ = runner.prepare_inputs(cmd.batch)
        runner.receive(inputs.input_ids.shape[0])
        with torch.no_grad():
            runner.pass_on(runner.graph.run(inputs))
        runner.worked()
        return
    prepared = runner.prepare_step(cmd.batch, cmd.eos_token_ids)
    runner.receive(prepared.inputs.input_ids.shape[0])
    try:
        with torch.no_grad():
            result: Any = runner.sample_tokens(runner.execute_model(prepared))
    except StepError as exc:
        if is_communication_failure(exc):
            raise
        result = StepFailed(str(exc))  # the group stays up: rank 0 ends this step's requests with it
    runner.worked()
    if placement.tp_rank_of(rank) == 0:
        source.reply(result)


def _device(config: Config) -> torch.device:
    from corerun.distributed.process_group import device_type

    return torch.device(device_type(config)) if device_type(config) == "cpu" else torch.device("cuda", torch.cuda.current_device())


def run_rank(launch: WorkerLaunch, rank: int, source: CommandSource, local_rank: int | None = None) -> None:
    """What every rank an executor starts runs: bind a device, join the default process group through
    the store at ``launch.store_host:store_port``, create the stages' groups, then :func:`serve` until
    rank 0 shuts down (the executor reports ``"started"`` before calling it).  Raises what :func:`serve`
    raises; the caller reports it with ``source.fail`` and ends the process or actor."""
    from datetime import timedelta

    import torch.distributed as dist

    from corerun.distributed.process_group import bind_device, destroy_group, init_group, stage_group

    config = Config.model_validate(launch.config)
    placement, world = launch.placement, launch.placement.world_size
    device = bind_device(config, rank if local_rank is None else local_rank, world, is_worker=True)
    store = dist.TCPStore(launch.store_host, launch.store_port, world, is_master=False,
                          timeout=timedelta(seconds=launch.timeout_s))
    group = init_group(launch.backend, store, rank, world, launch.timeout_s, device)
    try:
        if placement.pipeline_parallel_size > 1:
            serve(config, stage_group(placement, rank, device), source, placement, rank)
        else:
            serve(config, group, source)
    finally:
        destroy_group()


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
