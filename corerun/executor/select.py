"""The executor a configuration runs on (``distributed.executor``) and the engine's runner on top of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from corerun.config import Config
from corerun.errors import ConfigError
from corerun.plugin.registry import Registry, get_registry
from corerun.protocols.executor import Placement


@dataclass(frozen=True)
class ExecutorNeed:
    """What an executor must start (read by ``ExecutorCapabilities.fits``)."""

    device: Any
    placement: Placement
    multi_host: bool  # ranks joined through distributed.init_method, possibly on other hosts


def executor_name(config: Config, placement: Placement) -> str:
    """``distributed.executor``; ``auto``: ``inproc`` for one rank, ``launched`` when ``init_method`` is set, else ``local``."""
    name = config.distributed.executor
    if name != "auto":
        return name
    if placement.world_size == 1:
        return "inproc"
    return "launched" if config.distributed.init_method is not None else "local"


def make_executor(config: Config, placement: Placement, registry: Registry | None = None) -> tuple[str, Any]:
    """``(name, executor)`` for ``placement``; an executor whose capabilities do not fit is refused with every reason."""
    from corerun.distributed.process_group import device_type

    registry = registry or get_registry()
    need = ExecutorNeed(device_type(config), placement, config.distributed.init_method is not None)
    name = registry.select("executor", executor_name(config, placement), need, "distributed.executor").name
    return name, registry.create("executor", name, options=config.distributed.executor_options)


def check_combination(config: Config, placement: Placement) -> None:
    """What a placement of several ranks does not run yet, refused before any process starts."""
    if placement.world_size > 1 and config.speculative.method not in (None, "ngram"):
        raise ConfigError(
            f"speculative.method: {config.speculative.method!r} runs on one device only; use "
            "tensor_parallel_size: 1 and pipeline_parallel_size: 1, or leave speculative.method unset"
        )
    if placement.pipeline_parallel_size > 1 and config.scheduler.async_scheduling:
        raise ConfigError(
            f"scheduler.async_scheduling: true is not supported with pipeline_parallel_size "
            f"{placement.pipeline_parallel_size}; set async_scheduling: false"
        )


def make_runner(config: Config, registry: Registry | None = None) -> Any:
    """The engine's runner: a plain ModelRunner on the ``inproc`` executor, else rank 0 of the placement
    (:class:`~corerun.executor.driver.TensorParallelRunner`) driving the other ranks through the executor.
    A launched process whose ``RANK`` is not 0 serves rank 0 here and exits (``SystemExit(0)``)."""
    from corerun.executor.placement import placement_for

    placement = placement_for(config)
    check_combination(config, placement)
    name = executor_name(config, placement)
    if name == "launched":
        from corerun.executor.launched import launched_rank, serve_launched

        if launched_rank(config)[0] != 0:
            serve_launched(config)
            raise SystemExit(0)
    name, executor = make_executor(config, placement, registry)
    if name == "inproc":
        from corerun.runner.model_runner import ModelRunner

        return ModelRunner(config, registry)
    from corerun.executor.driver import TensorParallelRunner

    return TensorParallelRunner(config, registry, placement=placement, executor=executor)
