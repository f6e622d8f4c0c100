"""The ``compile`` graph runner: ``torch.compile`` of the composed model, attention kept out of the graph.

The model (embedding, norms, projections, rotary embedding, MLP, residuals) is compiled once with
dynamic token counts, so one compiled program serves decode, prefill and mixed steps.  Each layer's
attention call stays outside the compiled code as the opaque operator ``corerun::attention``
(:mod:`corerun.protocols.forward_context`): the compiled pieces between two attention calls are fused, and the
attention backend runs as it does eagerly, with the step's metadata planned outside, as in vLLM's
piecewise compilation.

On CPU, inductor generates C++ for the fused elementwise work and calls oneDNN for the matmuls;
``freeze: true`` also folds the weights into the program as constants and prepacks them for oneDNN
(faster matmuls, but the compiled program is then rebuilt at every start, where without freezing
inductor's cache makes a second start take seconds).  On CUDA the same compiled pieces run without
CUDA graphs (the ``cuda`` runner captures whole decode steps).

The first compile takes minutes on a small CPU, so ``auto`` never picks this runner; name it
(``graph: {runner: compile}``) where a long-running engine pays it back.  :meth:`CompileGraphRunner.capture`
compiles at startup with two padding decode steps (one token, then two: the compiler specialises
a count of one), so no request waits for the compiler.  Tensor-parallel steps are refused: their
all-reduces run inside the linear layers.
"""

from __future__ import annotations

import logging
import shutil
import time
from typing import Any, ClassVar

import torch

from corerun.errors import ConfigError, PluginUnavailableError
from corerun.protocols.forward_context import compiled_step
from corerun.graph.static_inputs import StaticDecodeInputs
from corerun.protocols.attention import AttentionBackend
from corerun.protocols.graph import GraphLimits, GraphStats, ModelFn, ModelInputs

logger = logging.getLogger("corerun.graph")

OPTIONS = {"freeze": bool, "warmup": bool}


def probe() -> list[str]:
    """Every reason ``torch.compile`` cannot run here (empty when it can)."""
    reasons = []
    if not hasattr(torch, "compile"):
        reasons.append(f"torch {torch.__version__} has no torch.compile (torch >= 2.4 needed)")
    if shutil.which("c++") is None and shutil.which("g++") is None and shutil.which("clang++") is None:
        reasons.append("no C++ compiler on PATH (inductor compiles the CPU kernels it generates; apt install g++)")
    return reasons


class CompileGraphRunner:
    """Runs every step through one ``torch.compile``-d model; ``stats.replays`` counts compiled steps.

    Factory signature ``CompileGraphRunner(model, attention, limits, freeze=False, warmup=True)``.
    """

    name: ClassVar[str] = "compile"

    def __init__(self, model: ModelFn, attention: AttentionBackend, limits: GraphLimits, **options: Any) -> None:
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ConfigError(f"graph.runner.options: unknown option(s) {unknown} for 'compile'; it takes {sorted(OPTIONS)}")
        for key, value in options.items():
            if not isinstance(value, bool):
                raise ConfigError(f"graph.runner.options.{key}: {value!r} is not a boolean; use true or false")
        self.attention = attention
        self.limits = limits
        self.freeze = bool(options.get("freeze", False))
        self.warmup = bool(options.get("warmup", True))
        self.stats = GraphStats()
        # no fullgraph: a model that calls something the compiler cannot trace still runs, in pieces
        self._compiled = torch.compile(model, dynamic=True, options={"freezing": self.freeze})

    def capture(self) -> None:
        """Compile now, on padding decode steps of one and two tokens (they write no KV-cache slot)."""
        if not self.warmup:
            logger.info("graph: runner 'compile' compiles on the first steps (warmup: false)")
            return
        start = time.perf_counter()
        static = StaticDecodeInputs(self.limits)
        try:
            for size in sorted({1, min(2, self.limits.max_batch_size)}):
                self.run(static.inputs(size))
        except Exception as exc:
            raise PluginUnavailableError(
                f"graph runner 'compile': torch.compile failed on a padding decode step: {type(exc).__name__}: {exc}"
            ) from exc
        self.stats.capture_seconds = time.perf_counter() - start
        self.stats.replays = 0
        logger.info(
            "graph: runner 'compile' compiled the model in %.1f s (freeze=%s; attention '%s' runs outside the compiled graph)",
            self.stats.capture_seconds, self.freeze, getattr(self.attention, "name", type(self.attention).__name__),
        )

    @torch.no_grad()
    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """Hidden states ``[inputs.batch.num_tokens, hidden_size]`` for the step."""
        metadata = self.attention.plan(inputs.batch)
        self.stats.replays += 1
        with compiled_step(self.attention, metadata):
            return self._compiled(inputs.input_ids, inputs.positions, metadata)
