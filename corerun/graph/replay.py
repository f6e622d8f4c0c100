"""The ``replay`` graph runner: a CPU's pure-decode steps recorded once per batch-size bucket and replayed without Python.

On a CPU a decode step of a few requests costs, besides its products, several milliseconds of Python between
the kernels (the default model's 30 layers make about 300 calls).  This runner records one step per bucket
with :func:`corerun.protocols.replay.record` (every computing call, bound to its arguments, on buffers that
stay put; see that module for the rules) and replays the kept calls for each later pure-decode step of at
most that many requests: what runs is the kernels, one after another.

It reuses the ``cuda`` runner's machinery (:class:`~corerun.graph.cuda.CudaGraphRunner`): the same buckets,
static inputs, padding rows, fallbacks and summary; prefill and mixed steps, and decode batches above the
largest bucket, run eagerly.  What differs is the capture:

- a recording that raises :class:`~corerun.protocols.replay.NotRecordable` leaves its bucket eager (logged
  once, with the reason);
- every recording is checked before it is kept: the static inputs are filled with other values (token 1 at
  position 1 of a two-token sequence, its K/V written to slot 1, after an eager step at position 0 wrote
  slot 0), the step runs eagerly and the tape replays, and the tape is kept only if both give the same hidden states, bit for bit (the same kernels on
  the same threads).  A component that computes outside the tape's sight (a C call not made through
  :func:`~corerun.protocols.replay.native`) shows here, and its bucket stays eager;
- steps with LoRA adapters are not recorded (the adapters' per-step state lives outside the model): with
  ``lora.enabled`` every step runs eagerly, counted as ``not_recorded`` (``auto`` does not pick this runner then).

Option ``max_batch_size`` (default :data:`DEFAULT_MAX_BATCH`) caps the largest bucket below
``graph.max_batch_size``: each bucket holds its own intermediate tensors (about 1.3 MB a token for the
default model in float32), and the share of a step spent in Python falls as the batch grows.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, ClassVar

import torch

from corerun.errors import ConfigError
from corerun.graph.buckets import capture_sizes
from corerun.graph.cuda import NOT_RECORDED, CudaGraphRunner
from corerun.protocols.attention import AttentionBackend, AttentionBatch
from corerun.protocols.graph import GraphLimits, ModelFn, ModelInputs
from corerun.protocols.step_layout import requests_step
from corerun.protocols.replay import NotRecordable, Tape, record

logger = logging.getLogger("corerun.graph")

DEFAULT_MAX_BATCH = 8


class TapeCapturer:
    """:class:`~corerun.graph.capturer.GraphCapturer` by recording: ``capture`` returns a :class:`Tape`."""

    def warmup(self, fn: Callable[[], None]) -> None:
        fn()

    def capture(self, fn: Callable[[], None]) -> Tape:
        with record() as tape:
            fn()
        return tape

    def memory_in_use(self) -> int:
        return 0

    def synchronize(self) -> None:
        pass


class ReplayGraphRunner(CudaGraphRunner):
    """Records pure-decode steps by batch-size bucket on a CPU and replays them; runs the rest eagerly.

    Factory signature ``ReplayGraphRunner(model, attention, limits, *, max_batch_size=8)``."""

    name: ClassVar[str] = "replay"

    def __init__(self, model: ModelFn, attention: AttentionBackend, limits: GraphLimits, *,
                 max_batch_size: int = DEFAULT_MAX_BATCH) -> None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ConfigError(f"graph.runner.options.max_batch_size: expected an integer >= 1, got {max_batch_size!r}")
        if torch.device(limits.device).type != "cpu":
            raise ConfigError(f"graph runner 'replay' runs on the CPU, got device '{limits.device}'; use 'cuda' or 'eager'")
        limits = dataclasses.replace(limits, max_batch_size=min(limits.max_batch_size, max_batch_size))
        super().__init__(model, attention, limits, capturer=TapeCapturer(), progress=False)
        self.graph_safe = True  # each recording is checked instead (capture)
        self.refusals: dict[int, str] = {}  # bucket -> why it runs eagerly
        self._recorded = False  # capture() ran (with or without a tape kept)

    @torch.no_grad()
    def capture(self) -> None:
        """Record, check and keep one tape per bucket, largest first; idempotent."""
        if self._graphs or self._recorded:
            return
        self._recorded = True
        if self.limits.lora:
            logger.info("graph: runner 'replay' does not record steps with LoRA adapters; every step runs eagerly")
            return
        start = time.perf_counter()
        for size in sorted(self.sizes, reverse=True):
            step = self._step(size, None)
            try:
                self.capturer.warmup(step)
                tape = self.capturer.capture(step)
                self._check(size, tape)
            except Exception as exc:  # NotRecordable, or the check's own steps refused (a cache too small): eager, not a crash
                self.refusals[size] = str(exc) if isinstance(exc, NotRecordable) else f"{type(exc).__name__}: {exc}"
                continue
            finally:
                self.static.pad(0, self.limits.max_batch_size)
            self._graphs[size] = (tape, None)
        self.sizes = sorted(self._graphs)
        self.stats.capture_seconds = time.perf_counter() - start
        self.stats.captured_sizes = list(self.sizes)
        if self.refusals:
            size, why = next(iter(self.refusals.items()))
            logger.warning("graph: replay: %d of %d buckets run eagerly (bucket %d: %s)",
                           len(self.refusals), len(self.refusals) + len(self.sizes), size, why)
        calls = len(self._graphs[self.sizes[-1]][0]) if self.sizes else 0
        logger.info("graph: replay recorded decode steps of %s requests in %.2f s (%d calls at the largest)",
                    ", ".join(map(str, self.sizes)) or "no", self.stats.capture_seconds, calls)

    def fallback_reason(self, batch: AttentionBatch) -> str | None:
        """As the ``cuda`` runner's, with ``not_recorded`` when capture kept no tape (LoRA, or every bucket refused)."""
        if self._recorded and not self._graphs:
            return NOT_RECORDED
        return super().fallback_reason(batch)

    def _step(self, size: int, metadata: Any) -> Callable[[], None]:
        """The recorded work for bucket ``size``: plan and model on the static rows, into the static hidden buffer
        (the plan inside the recording: a backend that copies the batch's tensors has its copies replayed)."""
        inputs, out, model, attention = self.static.inputs(size), self.hidden[:size], self.model, self.attention

        def step() -> None:
            out.copy_(model(inputs.input_ids, inputs.positions, attention.plan(inputs.batch)))

        return step

    def _eager(self, inputs: ModelInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, self.attention.plan(inputs.batch))

    def _check(self, size: int, tape: Tape) -> None:
        """The recording against an eager step on other inputs (module docstring); NotRecordable when they differ.

        Row ``i`` owns blocks ``2 (n - 1 - i) + 1`` and ``2 (n - 1 - i)`` (in that order: a block table that is not
        the identity) and token ``i % 2``.  A prefill writes each row's first block (positions ``0 .. B - 1``); a
        decoy decode of the other tokens writes position ``B``'s slot in the second block; then the tape replays
        the decode of the row's own token at position ``B`` and the same decode runs eagerly.  A replay that wrote
        no K/V would attend over the decoy's, one that read stale lengths, positions or block tables over the
        wrong positions, one with a stale embedding the wrong token."""
        n, bs = size, self.limits.block_size
        if self.static.max_blocks_per_seq < 2:
            raise NotRecordable(f"max_model_len {self.limits.max_model_len} is under two blocks of {bs}: too short for the check")
        tables = [[2 * (n - 1 - i) + 1, 2 * (n - 1 - i)] for i in range(n)]
        tokens = [i % 2 for i in range(n)]
        dev = self.limits.device
        self._eager(requests_step([0] * n, [bs] * n, tables, bs, dev, input_ids=[t for t in tokens for _ in range(bs)]))
        decoy = requests_step([bs] * n, [1] * n, tables, bs, dev, input_ids=[1 - t for t in tokens])
        self.static.load(decoy)
        self._eager(self.static.inputs(n))
        self.static.load(requests_step([bs] * n, [1] * n, tables, bs, dev, input_ids=tokens))
        tape.replay()
        replayed = self.hidden[:n].clone()
        eager = self._eager(self.static.inputs(n))
        if not torch.equal(eager, replayed):
            worst = (eager.float() - replayed.float()).abs().max().item()
            raise NotRecordable(
                f"the replayed step differs from the eager one on other inputs (max |difference| {worst:.3g}): "
                "something in the step computes outside the tape (a C call not made through corerun.protocols.replay.native, "
                "or Python that reads the data)"
            )
