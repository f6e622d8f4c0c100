"""The ``cuda`` graph runner: pure-decode steps replay CUDA graphs captured per batch-size bucket.

At :meth:`CudaGraphRunner.capture` (startup, after the KV cache exists) one graph is captured per
bucket (:func:`~corerun.graph.buckets.capture_sizes`), largest first, into one shared memory pool,
each after a warm-up run.  Every graph reads the runner's own static input tensors
(:class:`~corerun.graph.static_inputs.StaticDecodeInputs`) through a pure-decode
:class:`~corerun.protocols.attention.AttentionBatch` view, planned once at capture time, and writes
the runner's static hidden-state buffer.

A step replays when it is a pure decode of at most the largest bucket; its rows are copied into
the static tensors, the rows up to the bucket become padding (slot ``-1``: they write nothing), and
the first ``num_reqs`` output rows come back as a fresh tensor (a clone: the next replay overwrites
the static buffer).  Every other step runs eagerly, counted by reason in ``stats.fallbacks``.
The logits head and the sampler run outside, in the ModelRunner.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, ClassVar, Iterable, cast

import torch

from corerun.errors import ConfigError, PluginUnavailableError
from corerun.graph.buckets import bucket_for, capture_sizes
from corerun.graph.capturer import CapturedGraph, CudaGraphCapturer, GraphCapturer
from corerun.graph.eager import run_eager
from corerun.graph.static_inputs import StaticDecodeInputs
from corerun.protocols.attention import AttentionBackend, AttentionBatch
from corerun.protocols.graph import GraphLimits, GraphStats, ModelFn, ModelInputs

logger = logging.getLogger("corerun.graph")

# Keys of ``stats.fallbacks``, with what each means.
PREFILL = "prefill"
MIXED = "mixed"
BATCH_TOO_LARGE = "batch_too_large"
SEQ_TOO_LONG = "seq_too_long"
NOT_GRAPH_SAFE = "attention_not_graph_safe"
NOT_CAPTURED = "not_captured"
NOT_RECORDED = "not_recorded"
FALLBACK_REASONS: dict[str, str] = {
    PREFILL: "the step has no decodes; graphs hold pure-decode steps only",
    MIXED: "the step mixes prefill chunks and decodes; graphs hold pure-decode steps only",
    BATCH_TOO_LARGE: "more decode requests than the largest captured bucket",
    SEQ_TOO_LONG: "a sequence is longer than max_model_len, which sized the captured block table",
    NOT_GRAPH_SAFE: "the attention backend does not declare cuda_graph_decode",
    NOT_CAPTURED: "capture() has not been called",
    NOT_RECORDED: "the replay runner kept no recording (LoRA adapters, or every bucket refused: see its warning at capture)",
}


def probe() -> list[str]:
    """Every reason CUDA graphs cannot run in this process (empty when they can)."""
    try:
        import torch as _torch
    except ImportError as exc:  # pragma: no cover - corerun requires torch
        return [f"torch is not importable: {exc}"]
    reasons: list[str] = []
    if _torch.version.cuda is None and getattr(_torch.version, "hip", None) is None:
        reasons.append(f"torch {_torch.__version__} is a build without CUDA")
    if not _torch.cuda.is_available():
        reasons.append("needs a CUDA device (torch.cuda.is_available() is False)")
    return reasons


def _progress(sizes: list[int], enabled: bool) -> Iterable[int]:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a corerun dependency; a stripped environment still captures, silently
        return sizes
    return tqdm(sizes, desc="capturing CUDA graphs", unit="graph", disable=not enabled, leave=False)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


class CudaGraphRunner:
    """Captures pure-decode steps in CUDA graphs by batch-size bucket and replays them; runs the rest eagerly.

    Factory signature ``CudaGraphRunner(model, attention, limits, *, capturer=None, progress=True)``.

    ``capturer`` substitutes the capture mechanism (a :class:`~corerun.graph.capturer.GraphCapturer`);
    by default real CUDA graphs on ``limits.device``, which must be a CUDA device.  Only an injected
    capturer (for example :class:`~corerun.graph.capturer.EmulatedGraphCapturer` in tests) may run on
    another device.  ``progress`` shows a progress bar during capture.
    """

    name: ClassVar[str] = "cuda"

    def __init__(
        self,
        model: ModelFn,
        attention: AttentionBackend,
        limits: GraphLimits,
        *,
        capturer: GraphCapturer | None = None,
        progress: bool = True,
    ) -> None:
        device = torch.device(limits.device)
        if capturer is None:
            if device.type != "cuda":
                raise ConfigError(
                    f"graph runner 'cuda' needs a CUDA device, got device '{device}'; "
                    "use graph runner 'eager', or 'auto' (eager off CUDA)"
                )
            reasons = probe()
            if reasons:
                raise PluginUnavailableError("graph runner", "cuda", reasons)
            capturer = CudaGraphCapturer(device)
        elif not isinstance(capturer, GraphCapturer):
            raise TypeError(
                f"capturer must provide warmup/capture/memory_in_use/synchronize, got {type(capturer).__name__}"
            )
        self.model = model
        self.attention = attention
        self.limits = limits
        self.capturer = capturer
        self.progress = progress
        self.sizes = capture_sizes(limits.max_batch_size)
        caps = getattr(attention, "capabilities", None)
        self.graph_safe = bool(getattr(caps, "cuda_graph_decode", False))
        with torch.inference_mode(False):  # plain tensors, writable whether or not a later step runs in inference mode
            self.static = StaticDecodeInputs(limits)
            self.hidden = torch.empty(limits.max_batch_size, limits.hidden_size, dtype=limits.dtype, device=device)
        self.stats = GraphStats()
        self._graphs: dict[int, tuple[CapturedGraph, Any]] = {}  # bucket -> (graph, its capture-time plan)
        self._reported: set[str] = set()

    # ------------------------------------------------------------------ capture
    @torch.no_grad()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first, each after a warm-up run; idempotent."""
        if self._graphs:
            return
        if not self.graph_safe:
            logger.info(
                "graph: attention backend '%s' does not declare cuda_graph_decode; every step runs eagerly",
                getattr(self.attention, "name", type(self.attention).__name__),
            )
            return
        self.capturer.synchronize()
        memory_before = self.capturer.memory_in_use()
        start = time.perf_counter()
        for size in _progress(sorted(self.sizes, reverse=True), self.progress):
            metadata = self.attention.plan(self.static.batch(size))
            step = self._step(size, metadata)
            self.capturer.warmup(step)
            self._graphs[size] = (self.capturer.capture(step), metadata)
        self.capturer.synchronize()
        self.stats.capture_seconds = time.perf_counter() - start
        self.stats.capture_bytes = max(0, self.capturer.memory_in_use() - memory_before)
        self.stats.captured_sizes = list(self.sizes)
        logger.info(
            "graph: captured %d decode graphs (batch sizes %s) in %.2f s; graph memory %s, static buffers %s",
            len(self.sizes), _format_sizes(self.sizes), self.stats.capture_seconds,
            _mib(self.stats.capture_bytes), _mib(self.static.nbytes() + self.hidden.numel() * self.hidden.element_size()),
        )

    def _step(self, size: int, metadata: Any) -> Callable[[], None]:
        """The captured work for bucket ``size``: the model on the static rows, into the static hidden buffer."""
        input_ids, positions, out = self.static.input_ids[:size], self.static.positions[:size], self.hidden[:size]
        model = self.model

        def step() -> None:
            out.copy_(model(input_ids, positions, metadata))

        return step

    # ---------------------------------------------------------------------- run
    @torch.no_grad()
    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """Hidden states ``[inputs.batch.num_tokens, hidden_size]``: a graph replay when possible, else eager."""
        batch = inputs.batch
        reason = self.fallback_reason(batch)
        if reason is not None:
            return self._run_eager(inputs, reason)
        n = batch.num_reqs
        if inputs.input_ids.shape[0] != n or inputs.positions.shape[0] != n:
            raise ValueError(
                f"a pure-decode step has one token per request: {n} requests, but input_ids has "
                f"{inputs.input_ids.shape[0]} and positions {inputs.positions.shape[0]} tokens"
            )
        size = cast(int, bucket_for(n, self.sizes))  # fallback_reason ruled out n > largest bucket
        self.static.load(inputs)
        self._graphs[size][0].replay()
        self.stats.replays += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("graph: replayed bucket %d for %d decode requests", size, n)
        return self.hidden[:n].clone()

    def fallback_reason(self, batch: AttentionBatch) -> str | None:
        """Why ``batch`` must run eagerly (a key of :data:`FALLBACK_REASONS`), or ``None`` when a graph replays it."""
        if not self.graph_safe:
            return NOT_GRAPH_SAFE
        if not batch.is_pure_decode:
            return PREFILL if batch.num_decodes == 0 else MIXED
        if not self._graphs:
            return NOT_CAPTURED
        if batch.num_reqs > self.sizes[-1]:
            return BATCH_TOO_LARGE
        if batch.block_tables.shape[1] > self.static.max_blocks_per_seq or batch.max_seq_len > self.limits.max_model_len:
            return SEQ_TOO_LONG
        return None

    def _run_eager(self, inputs: ModelInputs, reason: str) -> torch.Tensor:
        self.stats.eager_steps += 1
        self.stats.fallbacks[reason] = self.stats.fallbacks.get(reason, 0) + 1
        if reason not in self._reported:
            self._reported.add(reason)
            level = logging.WARNING if reason in (NOT_CAPTURED, SEQ_TOO_LONG) else logging.INFO
            logger.log(level, "graph: eager step: %s (later such steps are logged at debug level)", FALLBACK_REASONS[reason])
        elif logger.isEnabledFor(logging.DEBUG):
            b = inputs.batch
            logger.debug("graph: eager step (%s): %d requests, %d tokens", reason, b.num_reqs, b.num_tokens)
        return run_eager(self.model, self.attention, inputs)

    # ------------------------------------------------------------------ summary
    def summary(self) -> str:
        """One line: replays, eager steps, and fallbacks by reason."""
        s = self.stats
        total = s.replays + s.eager_steps
        share = f" ({100 * s.replays / total:.0f}% of steps)" if total else ""
        fallbacks = ", ".join(f"{k}={v}" for k, v in sorted(s.fallbacks.items())) or "none"
        return f"graph: {s.replays} replays{share}, {s.eager_steps} eager steps; fallbacks: {fallbacks}"

    def log_summary(self) -> None:
        logger.info("%s", self.summary())


def _format_sizes(sizes: list[int]) -> str:
    if len(sizes) <= 8:
        return ", ".join(map(str, sizes))
    return ", ".join(map(str, sizes[:5])) + ", ..., " + str(sizes[-1])
