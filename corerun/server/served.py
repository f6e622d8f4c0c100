"""What the server serves: an engine front it queues requests on, reads limits, statistics and health from,
and shuts down.  Two kinds: :class:`LocalEngine` (an :class:`~corerun.llm.LLM` in the server's process)
and :class:`~corerun.server.data_parallel.front.DataParallelEngine` (replicas in their own processes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from corerun.engine.loop import RequestStream


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One engine's counters at one moment (what ``/metrics`` reads at scrape time). ``kv`` is None when the
    KV-cache manager's ``stats()`` failed (a plugin read racing a step): the next read tries again."""

    running: int
    waiting: int
    preemptions: int
    num_blocks: int | None = None
    free_blocks: int | None = None
    prefix_queries: int | None = None
    prefix_hits: int | None = None
    spec: tuple[int, int, int] | None = None  # drafts, draft tokens, accepted tokens (speculative decoding on)

    @property
    def kv(self) -> bool:
        return self.num_blocks is not None


def read_stats(engine: Any) -> EngineStats:
    """``engine``'s counters, read without waiting for its step (plain counters; a plugin's ``stats()`` may
    race the engine thread, and then only the KV part is missing)."""
    sched = engine.scheduler
    running, waiting, preemptions = len(sched.running), len(sched.waiting), sched.num_preemptions
    spec = getattr(engine, "spec_stats", None)
    drafts = None
    if getattr(engine, "proposer", None) is not None and spec is not None:
        drafts = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
    try:
        kv = engine.kv.stats()
    except Exception:  # noqa: BLE001 (a scrape must not fail)
        return EngineStats(running, waiting, preemptions, spec=drafts)
    return EngineStats(running, waiting, preemptions, kv.num_blocks, kv.num_free_blocks, kv.prefix_queries,
                       kv.prefix_hits, drafts)


class ServedEngine:
    """The server's view of what runs its requests. Attributes: ``config``, ``tokenizer``,
    ``max_model_len``, ``kv_tokens`` (the most K/V the smallest cache can hold for one request) and
    ``engine_labels`` (None for one engine; else the ``engine`` label of each, in order)."""

    config: Any
    tokenizer: Any
    max_model_len: int
    kv_tokens: int
    engine_labels: list[str] | None = None

    @property
    def model_pooling(self) -> Any:
        raise NotImplementedError

    async def add_request_async(self, prompt: list[int], params: Any, request_id: str, final_only: bool = False,
                                lora_request: Any = None) -> RequestStream:
        """Queue one request (with ``lora_request``, through that adapter); raises ``RequestError`` when
        refused, ``EngineClosedError`` when shut down."""
        raise NotImplementedError

    def abort(self, request_ids: Sequence[str], wait: bool = False) -> None:
        raise NotImplementedError

    def num_waiting(self) -> int:
        """Requests queued and not yet scheduled (the server's overload check)."""
        raise NotImplementedError

    def stats(self) -> list[EngineStats | None]:
        """Each engine's counters, in ``engine_labels`` order (None: that engine is not serving)."""
        raise NotImplementedError

    def engine_of(self, request_id: str) -> int | None:
        """The index of the engine a request was sent to (None with one engine, or when forgotten)."""
        return None

    def health(self) -> tuple[bool, dict[str, Any]]:
        """``(serving, body)`` for ``GET /health``."""
        return True, {"status": "ok"}

    def shutdown(self) -> None:
        raise NotImplementedError


class LocalEngine(ServedEngine):
    """An :class:`~corerun.llm.LLM` in the server's process: its one engine loop, shared with ``LLM.generate``."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.config = llm.config
        self.tokenizer = llm.get_tokenizer()
        runner = llm.engine.runner
        self.max_model_len = runner.max_model_len
        self.kv_tokens = runner.num_blocks * runner.block_size

    @property
    def model_pooling(self) -> Any:
        return self.llm.model_pooling

    async def add_request_async(self, prompt: list[int], params: Any, request_id: str, final_only: bool = False,
                                lora_request: Any = None) -> RequestStream:
        return await self.llm.engine_loop.add_request_async(prompt, params, request_id=request_id,
                                                            final_only=final_only, lora_request=lora_request)

    def abort(self, request_ids: Sequence[str], wait: bool = False) -> None:
        self.llm.engine_loop.abort(request_ids, wait=wait)

    def num_waiting(self) -> int:
        return len(self.llm.engine.scheduler.waiting)

    def stats(self) -> list[EngineStats | None]:
        return [read_stats(self.llm.engine)]

    def shutdown(self) -> None:
        self.llm.shutdown()


def served_engine(llm: Any) -> ServedEngine:
    """``llm`` as the server's view: a :class:`ServedEngine` as it is, an ``LLM`` in a :class:`LocalEngine`."""
    return llm if isinstance(llm, ServedEngine) else LocalEngine(llm)
