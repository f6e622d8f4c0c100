"""How a graph is captured and replayed, kept apart from what is captured.

:class:`~corerun.graph.cuda.CudaGraphRunner` owns the buckets, the static buffers, the padding and
the fallback rules; it hands a capturer zero-argument callables that read the static inputs and
write the static output.  :class:`CudaGraphCapturer` records them in real ``torch.cuda.CUDAGraph``
objects sharing one memory pool.  :class:`EmulatedGraphCapturer` stands in for it on any device:
"capture" keeps the callable and "replay" runs it again on the same buffers, with the plan made at
capture time, so the runner's own code runs unchanged on CPU in tests.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch

StepFn = Callable[[], None]


@runtime_checkable
class CapturedGraph(Protocol):
    def replay(self) -> None:
        """Run the captured work again on the current contents of the static buffers."""
        ...


@runtime_checkable
class GraphCapturer(Protocol):
    """The substitutable capture mechanism of :class:`~corerun.graph.cuda.CudaGraphRunner` (option ``capturer=``)."""

    def warmup(self, fn: StepFn) -> None:
        """Run ``fn`` once eagerly before its capture (lazy initialisation, kernel compilation, autotuning)."""
        ...

    def capture(self, fn: StepFn) -> CapturedGraph:
        """Record ``fn``; the result replays it."""
        ...

    def memory_in_use(self) -> int:
        """Device bytes in use now (compared before and after capture to report what the graphs took)."""
        ...

    def synchronize(self) -> None:
        """Wait for all queued device work."""
        ...


class CudaGraphCapturer:
    """Real CUDA graphs: one private memory pool shared by every graph, captured on one side stream.

    Graphs are captured largest first, so each smaller one reuses the pool memory of the larger.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaGraphCapturer needs a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=self.device)

    def warmup(self, fn: StepFn) -> None:
        # On the side stream, as torch's capture recipe asks, so lazy init lands where capture will run.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.synchronize()
        # what the warm-up freed stays cached in torch's general pool, which a capture cannot use:
        # hand it back so the graph pool does not need the step's memory twice
        torch.cuda.empty_cache()

    def capture(self, fn: StepFn) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            fn()
        self.synchronize()
        return graph

    def memory_in_use(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class EmulatedGraph:
    """A recorded callable; ``replay`` runs it again (with whatever it captured, e.g. the capture-time plan)."""

    def __init__(self, fn: StepFn) -> None:
        self.fn = fn
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.fn()


class EmulatedGraphCapturer:
    """Emulates CUDA-graph capture on any device, for tests and CPU smoke runs; never used in production.

    Faithful to the part of CUDA-graph semantics the runner relies on: capture records the work
    without running it, and a replay re-executes it on the *same* static tensors with the
    *capture-time* attention plan, so a runner that forgot to refresh a buffer, or a plan that
    copied values instead of referencing the batch, gives wrong results here as on a GPU.
    """

    def __init__(self) -> None:
        self.warmups = 0
        self.graphs: list[EmulatedGraph] = []

    def warmup(self, fn: StepFn) -> None:
        self.warmups += 1
        fn()

    def capture(self, fn: StepFn) -> EmulatedGraph:
        graph = EmulatedGraph(fn)  # like CUDA capture, recording runs nothing
        self.graphs.append(graph)
        return graph

    def memory_in_use(self) -> int:
        return 0

    def synchronize(self) -> None:
        pass
