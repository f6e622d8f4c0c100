"""``StageRunner``: the ModelRunner of one rank of a placement, running its pipeline stage's layers.

Stage ``s`` of a :class:`~corerun.protocols.executor.Placement` holds decoder layers
``stage_layers[s]`` and the KV cache of those layers only (every stage allocates the same block
count, agreed over all ranks, so the scheduler's block ids mean the same blocks everywhere).  A step
runs on every stage in turn: the first embeds the tokens, each later stage receives the hidden
states ``[num_tokens, hidden_size]`` from the same tensor-parallel rank of the stage before
(:meth:`receive`), runs its layers and passes them on (:meth:`pass_on`); the last stage applies the
final norm, computes the logits and samples.  With one stage it is a plain ModelRunner.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from corerun.config import Config
from corerun.distributed.group import TensorParallelGroup
from corerun.plugin.registry import Registry
from corerun.protocols.executor import Placement
from corerun.protocols.forward_context import AttentionContext
from corerun.runner.model_runner import ModelRunner


class StageRunner(ModelRunner):
    """Rank ``rank`` of ``placement``: ``tp`` its stage's tensor-parallel group (``None``: one rank per
    stage), ``world`` a group over every rank (the KV block count, stage hand-offs, batch snapshots)."""

    def __init__(
        self, config: Config, registry: Registry | None, tp: Any, placement: Placement, rank: int,
        world: TensorParallelGroup | None,
    ) -> None:
        self.placement, self.rank = placement, rank
        self.stage = placement.stage_of(rank)
        self.pipelined = placement.pipeline_parallel_size > 1
        self.stage_layers = placement.stage_layers[self.stage] if self.pipelined else None  # None: every layer
        self.is_first = self.stage == 0
        self.is_last = self.stage == placement.pipeline_parallel_size - 1
        self.placement_group = world  # construction agrees on the KV block count over it
        self._stage_in: torch.Tensor | None = None  # the stage before's hidden states for the current step
        # (start, end) wall-clock seconds of each step's work on this stage, newest last (pipeline parallel only)
        self.timeline: deque[tuple[float, float]] = deque(maxlen=1 << 16)
        self._started = 0.0
        super().__init__(config, registry, tp=tp)

    def _model_fn(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
        if not self.pipelined:
            return super()._model_fn(input_ids, positions, metadata)
        hidden = self._stage_in
        if hidden is None and not self.is_first:  # a profiling forward: no stage before it ran
            hidden = torch.zeros(input_ids.shape[0], self.model_config.hidden_size, dtype=self.dtype, device=self.device)
        ctx = AttentionContext(self.attention, metadata, self.kv_caches)
        return self.model.forward_stage(input_ids, positions, ctx, hidden, self.stage_layers)

    @property
    def pipeline_depth(self) -> int:
        """Micro-batches the engine keeps in flight: one per stage."""
        return self.placement.pipeline_parallel_size

    def receive(self, num_tokens: int) -> None:
        """The stage before's hidden states for this step's ``num_tokens`` tokens (nothing on the first stage);
        the step's work on this stage starts once they are in."""
        self._stage_in = None
        if not self.is_first:
            assert self.placement_group is not None
            shape = (num_tokens, self.model_config.hidden_size)
            self._stage_in = self.placement_group.recv(shape, self.dtype, self.rank - self.placement.tensor_parallel_size)
        self._started = time.time()

    def worked(self) -> None:
        """The step's work on this stage is done (its hidden states passed on, or its tokens sampled)."""
        self.timeline.append((self._started, time.time()))

    def pass_on(self, hidden: torch.Tensor) -> None:
        """This stage's hidden states to the same tensor-parallel rank of the next stage (not from the last)."""
        self._stage_in = None
        if not self.is_last:
            assert self.placement_group is not None
            self.placement_group.send(hidden, self.rank + self.placement.tensor_parallel_size)

    def describe(self) -> dict[str, str]:
        out = {**super().describe(), "tensor_parallel_size": str(self.placement.tensor_parallel_size)}
        if self.pipelined:
            out["pipeline_stages"] = " ".join(f"[{a},{b})" for a, b in self.placement.stage_layers)
        return out
