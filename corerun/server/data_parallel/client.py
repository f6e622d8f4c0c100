"""The API server's end of one replica (corerun/server/data_parallel/replica.py has the messages): starts
its process, queues requests on it and hands their outputs to the server's streams, counts its outstanding
tokens for the router, and notices when it dies.

A replica that dies (its pipe closes without ``bye``) is lost for good: every request it held gets a
final output with ``finish_reason="error"`` naming the replica and how its process ended, its
``lost`` message says the same, and it takes no new request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import signal
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from corerun.engine.loop import OutputQueue, RequestStream
from corerun.errors import CorerunError, EngineClosedError, RequestError
from corerun.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from corerun.server.data_parallel.replica import replica_main
from corerun.server.served import EngineStats

logger = logging.getLogger("corerun.server")


def describe_exit(code: int | None) -> str:
    if code is None:
        return "its process did not exit"
    if code < 0:
        try:
            return f"its process was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"its process was killed by signal {-code}"
    return f"its process exited with code {code}"


@dataclass(slots=True)
class _Route:
    outputs: OutputQueue
    prompt: list[int]
    embedding: bool
    max_tokens: int  # n * max_tokens: what the request may still generate, at most
    owed: int  # its outstanding tokens now (counted in ReplicaClient.outstanding)


class ReplicaClient:
    """One replica process and the pipe to it. ``start()`` it, then ``wait_ready()``; ``add`` / ``abort``
    from the server's event loop; ``call(fn)`` runs ``fn(llm)`` in the replica (tests read its state)."""

    def __init__(self, index: int, config: Any, ctx: Any, devices: str | None = None) -> None:
        self.index = index
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=replica_main, args=(index, config, theirs, devices),
                                   name=f"corerun-replica-{index}", daemon=False)  # (it may start its own workers)
        self._theirs = theirs
        self.info: dict[str, Any] = {}
        self.stats: EngineStats | None = None
        self.waiting = 0  # the replica's waiting queue, as it last said
        self.outstanding = 0  # tokens its requests still ask of it (the router's load)
        self.lost: str | None = None  # why it stopped serving; None while it serves
        self.closing = False
        self._routes: dict[str, _Route] = {}
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._calls: dict[int, Any] = {}
        self._tokens = itertools.count()
        self._lock = threading.Lock()  # guards _routes, _pending, outstanding, lost
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"corerun-replica-{index}-in", daemon=True)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def serving(self) -> bool:
        return self.lost is None and not self.closing

    def start(self) -> None:
        self.process.start()
        self._theirs.close()

    def wait_ready(self) -> dict[str, Any]:
        """Block until the replica has loaded its model (its ``info``); raise ``CorerunError`` if it failed."""
        while not self.conn.poll(0.5):
            if not self.process.is_alive():
                self.process.join(5)
                raise CorerunError(f"data-parallel replica {self.index} did not start: "
                                   f"{describe_exit(self.process.exitcode)}")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise CorerunError(f"data-parallel replica {self.index} did not start: "
                               f"{describe_exit(self.process.exitcode)}") from None
        if msg[0] == "failed":
            self.process.join(30)
            raise CorerunError(f"data-parallel replica {self.index} did not start: {msg[1]}")
        self.info = msg[1]
        self._reader.start()
        return self.info

    # ------------------------------------------------------------ requests
    async def add(self, prompt: list[int], params: Any, request_id: str, final_only: bool,
                  lora_request: Any = None) -> RequestStream:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        n = getattr(params, "n", 1) or 1
        max_tokens = n * (getattr(params, "max_tokens", None) or 1)
        route = _Route(OutputQueue.for_asyncio(loop), list(prompt), getattr(params, "pooling", None) is not None,
                       max_tokens, len(prompt) + max_tokens)
        with self._lock:
            if not self.serving:
                raise EngineClosedError(f"data-parallel replica {self.index} is not serving: {self.lost or 'closing'}")
            self._routes[request_id] = route
            self._pending[request_id] = (loop, fut)
            self.outstanding += route.owed
        self._send(("add", request_id, list(prompt), params, final_only, lora_request))
        try:
            error = await fut
        except BaseException:  # cancelled while queued: nobody will read it (the abort follows the add)
            self.abort([request_id])
            raise
        if error is not None:
            self._end(request_id)
            kind, message = error
            if kind == "EngineClosedError":
                raise EngineClosedError(message)
            raise RequestError(message if kind == "RequestError" else f"{kind}: {message}")
        return RequestStream(request_id, route.outputs, self)  # type: ignore[arg-type]

    def abort(self, request_ids: Sequence[str], wait: bool = False) -> None:
        """End these requests as ``abort`` (ids this replica does not hold are ignored); never waits."""
        mine = [r for r in request_ids if r in self._routes]
        if mine and self.lost is None:
            self._send(("abort", mine))

    def holds(self, request_id: str) -> bool:
        return request_id in self._routes

    def held(self) -> list[str]:
        """The ids of the requests this replica runs now."""
        return list(self._routes)

    def call(self, fn: Any, timeout: float = 30.0) -> Any:
        """``fn(llm)`` run in the replica (``fn`` must pickle: a module-level function); its value."""
        token = next(self._tokens)
        done = threading.Event()
        box: list[Any] = [done]
        self._calls[token] = box
        self._send(("call", token, fn))
        if not done.wait(timeout):
            self._calls.pop(token, None)
            raise TimeoutError(f"data-parallel replica {self.index} did not answer within {timeout} s")
        _, ok, value = box
        if not ok:
            raise CorerunError(f"data-parallel replica {self.index}: {value}")
        return value

    def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the replica to stop (it aborts what it still runs), wait for it, kill it if it does not exit."""
        self.closing = True
        if self.process.pid is None:
            return
        if self.lost is None and self.process.is_alive():
            try:
                self._send(("shutdown",))
            except (OSError, ValueError):
                pass
        self.process.join(timeout)
        if self.process.is_alive():
            logger.error("data-parallel replica %d (pid %s) did not stop within %s s: killing it", self.index,
                         self.pid, timeout)
            self.process.kill()
            self.process.join(5)
        if self._reader.is_alive():
            self._reader.join(5)
        self.conn.close()

    # ------------------------------------------------------------ internals
    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self.conn.send(msg)
        except (OSError, ValueError):  # it died: its reader sees the pipe close and fails what it held
            logger.debug("sending to data-parallel replica %d failed", self.index, exc_info=True)

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self._lose()
                return
            kind = msg[0]
            if kind == "out":
                for rid, out in msg[1]:
                    self._deliver(rid, out)
            elif kind == "added":
                _, rid, error, waiting = msg
                self.waiting = waiting
                entry = self._pending.pop(rid, None)
                if entry is not None:
                    _resolve(entry, error)
            elif kind == "stats":
                self.stats, self.waiting = msg[1], msg[1].waiting
            elif kind == "called":
                box = self._calls.pop(msg[1], None)
                if box is not None:
                    box[1:] = [msg[2], msg[3]]
                    box[0].set()
            elif kind == "bye":
                self._lose(expected=True)
                return

    def _deliver(self, rid: str, out: Any) -> None:
        route = self._routes.get(rid)
        if route is None:
            return
        if isinstance(out, RequestOutput):
            out.metrics["engine"] = self.index  # which replica served it (the server's metrics label)
            made = max((len(c.token_ids) for c in out.outputs), default=0)
            with self._lock:
                owed = max(route.max_tokens - made * len(out.outputs), 0)
                self.outstanding += owed - route.owed
                route.owed = owed
        route.outputs.put(out)
        if isinstance(out, BaseException) or out.finished:
            self._end(rid)

    def _end(self, rid: str) -> None:
        with self._lock:
            route = self._routes.pop(rid, None)
            if route is not None:
                self.outstanding -= route.owed

    def _lose(self, expected: bool = False) -> None:
        if self.lost is not None:
            return
        self.process.join(10 if expected else 1)  # (its pipe closed: it is exiting, if not gone already)
        how = describe_exit(self.process.exitcode)
        with self._lock:
            if self.lost is not None:
                return
            self.lost = f"data-parallel replica {self.index} (pid {self.pid}) stopped: {how}"
            routes, self._routes = self._routes, {}
            pending, self._pending = self._pending, {}
            self.outstanding = 0
            calls, self._calls = self._calls, {}
        if not expected or routes:
            logger.error("%s; failing its %d request(s) in flight", self.lost, len(routes))
        for rid, route in routes.items():
            route.outputs.put(_error_output(rid, route, f"{self.lost}; the request was running there"))
        for entry in pending.values():
            _resolve(entry, None)  # its stream holds the error output already
        for box in calls.values():
            box[1:] = [False, self.lost]
            box[0].set()


def _resolve(entry: tuple[asyncio.AbstractEventLoop, asyncio.Future], value: Any) -> None:
    loop, fut = entry

    def settle() -> None:
        if not fut.done():
            fut.set_result(value)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # its event loop is closed: nobody waits
        pass


def _error_output(rid: str, route: _Route, message: str) -> Any:
    if route.embedding:
        return EmbeddingRequestOutput(request_id=rid, prompt=None, prompt_token_ids=route.prompt,
                                      outputs=EmbeddingOutput(embedding=[]), finished=True, finish_reason="error",
                                      error=message)
    return RequestOutput(request_id=rid, prompt=None, prompt_token_ids=route.prompt,
                         outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="error", error=message)],
                         finished=True)
