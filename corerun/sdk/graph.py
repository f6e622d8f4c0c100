"""Graph-runner building blocks: corerun's ``eager`` runner as a base class, and the CPU ``replay`` runner's tape.

:class:`EagerGraphRunner` plans each batch and runs the model, every step, on any device; a runner
that captures subclasses it and overrides ``capture()`` and ``run(inputs)``, as
``corerun new graph NAME`` generates.  :func:`native`, :func:`record`, :func:`recording` and
:class:`NotRecordable` are :mod:`corerun.protocols.replay`'s: a plugin whose kernels are C calls made through
``ctypes`` routes them through :func:`native` so that the ``replay`` runner can record them (docs/graphs.md).  To test one without a GPU, see
:func:`corerun.testing.emulated_cuda_graph_runner` and :class:`corerun.testing.EmulatedGraphCapturer`.
"""

from __future__ import annotations

from corerun.graph.eager import EagerGraphRunner
from corerun.protocols.replay import NotRecordable, native, record, recording

__all__ = ["EagerGraphRunner", "NotRecordable", "native", "record", "recording"]
