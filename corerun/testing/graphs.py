"""CUDA-graph capture on any device, for a plugin's tests: corerun's own ``cuda`` graph runner with
the capture emulated (:class:`EmulatedGraphCapturer`), so an attention backend's ``cuda_graph_decode``
promise (a capture-time plan serves every replay) is tested without a GPU."""

from __future__ import annotations

from typing import Any

from corerun.graph.capturer import EmulatedGraphCapturer


def emulated_cuda_graph_runner(model: Any, attention: Any, limits: Any) -> Any:
    """The built-in ``cuda`` graph runner, ``factory(model, attention, limits)`` as the graph-runner
    protocol builds it, capturing with an :class:`EmulatedGraphCapturer` on whatever device
    ``limits.device`` names: a replay re-runs the captured step on the same static tensors with the
    capture-time attention plan, as a CUDA graph does."""
    from corerun.graph.cuda import CudaGraphRunner

    return CudaGraphRunner(model, attention, limits, capturer=EmulatedGraphCapturer(), progress=False)


__all__ = ["EmulatedGraphCapturer", "emulated_cuda_graph_runner"]
