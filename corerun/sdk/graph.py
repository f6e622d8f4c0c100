"""Graph-runner building blocks: corerun's ``eager`` runner as a base class.

:class:`EagerGraphRunner` plans each batch and runs the model, every step, on any device; a runner
that captures subclasses it and overrides ``capture()`` and ``run(inputs)``, as
``corerun new graph NAME`` generates.  To test one without a GPU, see
:func:`corerun.testing.emulated_cuda_graph_runner` and :class:`corerun.testing.EmulatedGraphCapturer`.
"""

from __future__ import annotations

from corerun.graph.eager import EagerGraphRunner

__all__ = ["EagerGraphRunner"]
