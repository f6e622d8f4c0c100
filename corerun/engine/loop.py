"""One engine loop shared by every caller: the front that ``LLM`` and a server sit on.

A background thread owns the :class:`LLMEngine`: it applies the callers' commands (add, abort)
between steps, runs the steps, and puts each request's outputs on the queue that request was added
with. Any number of threads (or asyncio tasks) add requests and read their own outputs; no caller
ever sees another's, and no output is lost however slowly a queue is read.

    loop = EngineLoop(engine)
    stream = loop.add_request([1, 2, 3], SamplingParams(max_tokens=8))   # -> RequestStream
    for out in stream: ...                    # cumulative RequestOutput per token, ``finished`` last
    async for out in loop.add_request(...):   # the same from asyncio (outputs cross threads safely)
    loop.abort(["3"])                         # any thread, any time: waiting or running -> "abort"
    loop.shutdown()                           # aborts what is left, stops the thread

The thread runs only while there is work and exits when idle, so an idle loop keeps nothing alive:
dropping the last reference to the engine frees it (KV cache, graphs) at once.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator, Sequence as Seq

from corerun.engine.llm_engine import LLMEngine, Prompt
from corerun.core.sequence import Sequence, SequenceStatus
from corerun.errors import EngineClosedError, RequestError, StepError
from corerun.lora.request import LoRARequest
from corerun.outputs import RequestOutput
from corerun.sampling_params import SamplingParams

logger = logging.getLogger("corerun.engine")

_LIVE: "weakref.WeakSet[EngineLoop]" = weakref.WeakSet()


@atexit.register
def _stop_live_loops() -> None:
    """At interpreter exit, stop loops still running (a stream left unread): a daemon thread killed in
    the middle of a step can abort the process on its way out."""
    for loop in list(_LIVE):
        loop.shutdown(timeout=10)


class OutputQueue:
    """Where the loop puts the outputs of the requests added with it (a ``RequestOutput``, or an
    exception to raise in the reader). Thread-safe; made with ``for_asyncio()`` it is read with
    ``await get_async()`` on that event loop instead of ``get()``."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._aq: asyncio.Queue[Any] | None = None

    @classmethod
    def for_asyncio(cls, loop: asyncio.AbstractEventLoop | None = None) -> "OutputQueue":
        q = cls()
        q._aloop = loop or asyncio.get_running_loop()
        q._aq = asyncio.Queue()
        return q

    def put(self, item: RequestOutput | BaseException) -> None:
        if self._aq is None:
            self._q.put(item)
            return
        try:
            self._aloop.call_soon_threadsafe(self._aq.put_nowait, item)  # type: ignore[union-attr]
        except RuntimeError:  # the event loop is closed: nobody is left to read
            pass

    def get(self, timeout: float | None = None) -> RequestOutput:
        if self._aq is not None:
            raise RuntimeError("this OutputQueue belongs to an asyncio loop: use await get_async()")
        return _raise_or_return(self._q.get(timeout=timeout))

    async def get_async(self) -> RequestOutput:
        if self._aq is None:
            raise RuntimeError("this OutputQueue was not made with OutputQueue.for_asyncio()")
        return _raise_or_return(await self._aq.get())


def _raise_or_return(item: Any) -> RequestOutput:
    if isinstance(item, BaseException):
        raise item
    return item


class RequestStream:
    """The outputs of one request, in order: iterate it (``for`` or ``async for``); the last is ``finished``."""

    def __init__(self, request_id: str, outputs: OutputQueue, loop: "EngineLoop") -> None:
        self.request_id = request_id
        self._outputs = outputs
        self._loop = loop
        self.finished = False

    def get(self, timeout: float | None = None) -> RequestOutput:
        out = self._outputs.get(timeout)
        self.finished = out.finished
        return out

    async def get_async(self) -> RequestOutput:
        out = await self._outputs.get_async()
        self.finished = out.finished
        return out

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            yield self.get()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            yield await self.get_async()

    def abort(self, wait: bool = True) -> None:
        """End the request as ``abort`` (no-op once finished); ``wait=False`` returns before it is applied."""
        self._loop.abort([self.request_id], wait=wait)


@dataclass(slots=True)
class _Route:
    seq: Sequence
    outputs: OutputQueue
    final_only: bool


class EngineLoop:
    """The shared front of one :class:`LLMEngine`; see the module docstring."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cv = threading.Condition(threading.Lock())  # guards _commands, _thread, _closed
        self._commands: list[tuple[Callable[[], Any], Future]] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._routes: dict[str, _Route] = {}  # touched by the loop thread only
        _LIVE.add(self)

    # ------------------------------------------------------------ callers
    def add_requests(
        self,
        prompts: Seq[Prompt],
        params: Seq[SamplingParams | dict | None],
        outputs: OutputQueue,
        *,
        final_only: bool = False,
        request_ids: Seq[str | None] | None = None,
        lora_requests: Seq[LoRARequest | None] | None = None,
    ) -> list[str]:
        """Validate every request, then queue them all (or none: the first bad one raises
        ``RequestError("prompt i: ...")``). Their outputs go to ``outputs``: each token's cumulative
        output, or with ``final_only`` the last one only. Returns the request ids."""
        if len(params) != len(prompts):
            raise RequestError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        ids = list(request_ids) if request_ids is not None else [None] * len(prompts)
        loras = list(lora_requests) if lora_requests is not None else [None] * len(prompts)
        if len(loras) != len(prompts):
            raise RequestError(f"{len(loras)} lora_requests for {len(prompts)} prompts")
        self._warm(params)
        return self._admitted(self._submit(lambda: self._admit(prompts, params, ids, outputs, final_only, True, loras)))

    def add_request(
        self, prompt: Prompt, params: SamplingParams | dict | None = None, request_id: str | None = None,
        *, final_only: bool = False, lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue one request; its outputs come through the returned stream. Raises ``RequestError`` when refused."""
        outputs = OutputQueue()
        self._warm([params])
        fut = self._submit(lambda: self._admit([prompt], [params], [request_id], outputs, final_only, False, [lora_request]))
        (rid,) = self._admitted(fut)
        return RequestStream(rid, outputs, self)

    async def add_request_async(
        self, prompt: Prompt, params: SamplingParams | dict | None = None, request_id: str | None = None,
        *, final_only: bool = False, lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """``add_request`` for asyncio callers: does not block the event loop; read with ``async for``."""
        outputs = OutputQueue.for_asyncio()
        if self._wants_processors(params):  # (a grammar compiles on a worker thread, not the event loop)
            await asyncio.to_thread(self._warm, [params])
        fut = self._submit(lambda: self._admit([prompt], [params], [request_id], outputs, final_only, False, [lora_request]))
        try:
            (rid,) = await asyncio.shield(asyncio.wrap_future(fut))
        except BaseException:  # cancelled while admitted: nobody will read these requests
            fut.add_done_callback(self._abort_orphans)
            raise
        return RequestStream(rid, outputs, self)

    def _wants_processors(self, params: Any) -> bool:
        procs = getattr(self.engine.runner, "logits_processors", None)
        return procs is not None and params is not None and not isinstance(params, dict) and procs.wanted(params)

    def _warm(self, params: Seq[Any]) -> None:
        """Compile structured-output grammars on the caller's thread, so admission on the loop's
        thread finds them cached instead of compiling between two steps (corerun.runner.logits_processing)."""
        if any(self._wants_processors(p) for p in params):
            self.engine.runner.logits_processors.warm(params)

    def abort(self, request_ids: Seq[str], wait: bool = True) -> None:
        """End these requests as ``abort`` and free their blocks, wherever they are (waiting,
        mid-prefill, decoding). Finished and unknown ids are ignored. With ``wait`` (the default)
        this returns once it is done: the requests' final outputs are on their queues."""
        ids = list(request_ids)
        try:
            fut = self._submit(lambda: self._abort(ids))
        except EngineClosedError:
            return  # shutdown aborted everything already
        if wait:
            fut.result()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort every request still in flight (their readers get the ``abort`` output), stop the
        thread, refuse new requests. Safe to call twice."""
        with self._cv:
            self._closed = True
            thread = self._thread
            self._cv.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def num_in_flight(self) -> int:
        return len(self._routes)

    # ------------------------------------------------------------ internals
    def _admitted(self, fut: Future) -> list[str]:
        """The ids an add command queued. A caller interrupted while waiting (Ctrl-C) will never read
        them: they are aborted once admitted instead of running on unread."""
        try:
            return fut.result()
        except BaseException:
            fut.add_done_callback(self._abort_orphans)
            raise

    def _abort_orphans(self, fut: Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            try:
                self.abort(fut.result(), wait=False)
            except Exception:  # noqa: BLE001 (closed meanwhile: shutdown aborted them)
                pass

    def _submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise EngineClosedError("the engine was shut down; make a new LLM")
            self._commands.append((fn, fut))
            if self._thread is None:
                self._start_thread()
            self._cv.notify()
        return fut

    def _start_thread(self) -> None:  # (with self._cv held)
        self._thread = threading.Thread(target=self._run, name="corerun-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # a bug in the loop itself: no caller may wait forever
            logger.exception("the engine loop failed")
            err = StepError(f"the engine loop failed: {type(exc).__name__}: {exc}")
            for rid, route in list(self._routes.items()):
                self._routes.pop(rid, None)
                route.outputs.put(err)
                try:
                    self.engine.abort(rid)
                    self.engine.release(rid)
                except Exception:  # noqa: BLE001 (already failing; the routes got the error)
                    pass
            with self._cv:
                self._thread = None
                if self._commands:  # sent after the failure: a fresh thread serves them
                    self._start_thread()

    def _serve(self) -> None:
        while True:
            with self._cv:
                commands, self._commands = self._commands, []
                closed = self._closed
                if not commands and not self._routes and not closed:
                    self._thread = None  # idle: exit, holding nothing
                    return
            for fn, fut in commands:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                        fut.set_exception(exc)
            if closed:
                self._abort(list(self._routes))
                with self._cv:
                    for _, fut in self._commands:
                        fut.set_exception(EngineClosedError("the engine was shut down; make a new LLM"))
                    self._commands = []
                    self._thread = None
                return
            self._collect_outside_aborts()
            if self._routes:
                self._step()

    def _admit(self, prompts: Seq[Prompt], params: Seq[Any], ids: Seq[str | None], outputs: OutputQueue,
               final_only: bool, name_index: bool, loras: Seq[LoRARequest | None] | None = None) -> list[str]:
        engine = self.engine
        seqs: list[Sequence] = []
        taken: set[str] = set()
        for i, (p, sp, rid) in enumerate(zip(prompts, params, ids)):
            try:
                seq = engine.make_sequence(p, sp, rid, loras[i] if loras is not None else None)
                if seq.request_id in taken:
                    raise RequestError(f"request_id {seq.request_id!r} is already in use")
            except (RequestError, ValueError) as exc:
                raise RequestError(f"prompt {i}: {exc}" if name_index else str(exc)) from None
            taken.add(seq.request_id)
            seqs.append(seq)
        for seq in seqs:
            engine.queue_sequence(seq)
            self._routes[seq.request_id] = _Route(seq, outputs, final_only)
        return [s.request_id for s in seqs]

    def _abort(self, ids: Seq[str]) -> None:
        engine = self.engine
        for rid in ids:
            route = self._routes.get(rid)
            engine.abort(rid)
            if route is not None:
                if not route.seq.is_finished:  # not the engine's own request table: finish it here
                    route.seq.status, route.seq.finish_reason = SequenceStatus.FINISHED, "abort"
                self._deliver(route.seq, route)
        engine.take_aborted()  # delivered just now

    def _collect_outside_aborts(self) -> None:
        """Requests aborted with ``engine.abort()`` directly (not through this loop): deliver their end."""
        for seq in self.engine.take_aborted():
            route = self._routes.get(seq.request_id)
            if route is not None and route.seq is seq:
                self._deliver(seq, route)

    def _step(self) -> None:
        engine = self.engine
        try:
            touched = engine.step()
        except Exception as exc:  # the engine catches plugin faults itself; this is a bug: fail its requests
            logger.exception("engine step raised")
            err = StepError(f"engine step raised {type(exc).__name__}: {exc}")
            for rid in list(self._routes):
                route = self._routes.pop(rid)
                engine.abort(rid)
                engine.release(rid)
                route.outputs.put(err)
            engine.take_aborted()
            return
        for seq in touched:  # a Sequence, or the SequenceGroup of an n > 1 request (its .head was queued)
            route = self._routes.get(seq.request_id)
            if route is not None and route.seq is getattr(seq, "head", seq) and (seq.is_finished or not route.final_only):
                self._deliver(seq, route)
        if not touched and not engine.has_unfinished_requests():
            # nothing left to run: a route whose request was finished or released behind our back
            for route in list(self._routes.values()):
                if not route.seq.is_finished:
                    route.seq.status, route.seq.finish_reason = SequenceStatus.FINISHED, "abort"
                self._deliver(route.seq, route)

    def _deliver(self, seq: Sequence, route: _Route) -> None:
        try:
            out = self.engine.output(seq)
        except Exception as exc:  # detokenizing failed: the request ends with the error, the others go on
            logger.exception("building the output of request %r failed", seq.request_id)
            self.engine.abort(seq.request_id)
            out = _error_output(seq, f"building the output failed: {type(exc).__name__}: {exc}")
        if out.finished:  # forget it before the reader can see the end
            self._routes.pop(seq.request_id, None)
            self.engine.release(seq.request_id)
        route.outputs.put(out)


def _error_output(seq: Sequence, message: str) -> RequestOutput:
    from corerun.outputs import CompletionOutput

    return RequestOutput(
        request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=list(seq.prompt_token_ids),
        outputs=[CompletionOutput(index=0, text="", token_ids=seq.output_token_ids, finish_reason="error",
                                  error=message)],
        finished=True,
    )
