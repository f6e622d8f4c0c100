"""The ``eager`` graph runner: every step is ``attention.plan(batch)`` then the model, nothing captured."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch

from corerun.protocols.attention import AttentionBackend
from corerun.protocols.graph import GraphLimits, GraphStats, ModelFn, ModelInputs

logger = logging.getLogger("corerun.graph")


def run_eager(model: ModelFn, attention: AttentionBackend, inputs: ModelInputs) -> torch.Tensor:
    """One eager step: plan the batch, run the model. Returns hidden ``[num_tokens, hidden_size]``."""
    metadata = attention.plan(inputs.batch)
    return model(inputs.input_ids, inputs.positions, metadata)


class EagerGraphRunner:
    """Runs every step eagerly; works on any device and with any attention backend.

    Factory signature ``EagerGraphRunner(model, attention, limits)``.  ``stats.eager_steps`` counts steps.
    """

    name: ClassVar[str] = "eager"

    def __init__(self, model: ModelFn, attention: AttentionBackend, limits: GraphLimits, **options: Any) -> None:
        if options:
            raise TypeError(f"graph runner 'eager' takes no options, got {sorted(options)}")
        self.model = model
        self.attention = attention
        self.limits = limits
        self.stats = GraphStats()

    def capture(self) -> None:
        logger.info("graph: runner 'eager' captures nothing; every step runs eagerly")

    @torch.no_grad()
    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """Hidden states ``[inputs.batch.num_tokens, hidden_size]`` for the step."""
        self.stats.eager_steps += 1
        return run_eager(self.model, self.attention, inputs)
