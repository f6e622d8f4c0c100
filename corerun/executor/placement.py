"""Which placement a configuration asks for: ``tensor_parallel_size x pipeline_parallel_size`` ranks, and
the layers of each pipeline stage (``distributed.pipeline_layers``, or computed from the model's depth)."""

from __future__ import annotations

from corerun.config import Config
from corerun.errors import ConfigError
from corerun.protocols.executor import Placement


def placement_for(config: Config) -> Placement:
    """The placement of ``config``; raises ConfigError naming the field, its value and what would fit."""
    from corerun.models.config import ModelConfig
    from corerun.runner.construction import model_dir_for

    tp, pp, layers = config.tensor_parallel_size, config.pipeline_parallel_size, config.distributed.pipeline_layers
    if pp == 1 and layers is None:
        return Placement(tp, 1, ((0, 0),))  # one stage: every layer, whatever the depth
    num_layers = ModelConfig.from_model_dir(model_dir_for(config)).num_layers
    try:
        return Placement.of(tp, pp, num_layers, layers)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
