"""One data-parallel replica: an :class:`~corerun.llm.LLM` in its own process, served over a pipe.

The API server's :class:`~corerun.server.data_parallel.client.ReplicaClient` is the other end.  Messages
are tuples of plain values, pickled by the pipe:

    server -> replica   ("add", request_id, prompt_ids, params, final_only, lora_request)   queue one request
                        ("abort", [request_id, ...])                          end these as ``abort``
                        ("call", token, fn)                                   run ``fn(llm)``, answer its value
                        ("shutdown",)                                         abort what is left, then exit
    replica -> server   ("ready", info) | ("failed", message)                 once, after loading
                        ("added", request_id, (kind, message) or None, waiting)   answer to each "add"
                        ("out", [(request_id, output or exception), ...])     outputs, in order, batched
                        ("stats", EngineStats)                                when they change (10 a second at most)
                        ("called", token, ok, value)                          answer to each "call"
                        ("bye",)                                              last, after the final outputs

Commands are applied in the order they were sent, so an abort sent after an add always finds its
request.  The replica ignores SIGINT (Ctrl-C reaches the whole process group; the server decides when
replicas stop) and exits when the server's end of the pipe closes, so it never outlives the server.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

STATS_PERIOD_S = 0.1
_BATCH = 256  # outputs sent in one message at most
_DONE = object()


def replica_main(index: int, config: Any, conn: Connection, devices: str | None) -> None:
    """The replica process's entry point (``multiprocessing`` target): load, announce, serve until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if devices is not None:  # before anything initialises CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        from corerun.llm import LLM

        llm = LLM(config=config)
    except BaseException as exc:  # noqa: BLE001 (told to the server, which names the replica)
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        conn.close()
        return
    _Replica(index, llm, conn).serve()


class _Outputs:
    """Where the engine loop puts one request's outputs: onto the replica's outbox, tagged with its id."""

    __slots__ = ("rid", "box")

    def __init__(self, rid: str, box: "queue.SimpleQueue[Any]") -> None:
        self.rid, self.box = rid, box

    def put(self, item: Any) -> None:
        self.box.put((self.rid, item))


class _Replica:
    def __init__(self, index: int, llm: Any, conn: Connection) -> None:
        self.index, self.llm, self.conn = index, llm, conn
        self.box: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.lock = threading.Lock()  # one message on the pipe at a time
        self.sender = threading.Thread(target=self._send_outputs, name=f"corerun-replica-{index}-out", daemon=True)

    def send(self, msg: tuple) -> None:
        with self.lock:
            self.conn.send(msg)

    def serve(self) -> None:
        runner = self.llm.engine.runner
        self.send(("ready", {"pid": os.getpid(), "model_dir": str(runner.model_dir),
                             "max_model_len": runner.max_model_len, "block_size": runner.block_size,
                             "kv_tokens": runner.num_blocks * runner.block_size}))
        self.sender.start()
        try:
            while self._apply(self.conn.recv()):
                pass
        except (EOFError, OSError):  # the server is gone: stop with it
            pass
        finally:
            self.llm.shutdown()  # aborts what is left: their final outputs reach the outbox first
            self.box.put(_DONE)
            self.sender.join(30)
            self.conn.close()

    def _apply(self, msg: tuple) -> bool:
        kind = msg[0]
        if kind == "add":
            _, rid, prompt, params, final_only, lora = msg
            error = None
            try:
                self.llm.engine_loop.add_requests([prompt], [params], _Outputs(rid, self.box),  # type: ignore[arg-type]
                                                  final_only=final_only, request_ids=[rid], lora_requests=[lora])
            except Exception as exc:  # noqa: BLE001 (the request's fault, or the engine closing: told to the server)
                error = (type(exc).__name__, str(exc).removeprefix("prompt 0: "))
            self.send(("added", rid, error, len(self.llm.engine.scheduler.waiting)))
        elif kind == "abort":
            self.llm.engine_loop.abort(msg[1], wait=False)
        elif kind == "call":
            _, token, fn = msg
            try:
                self.send(("called", token, True, fn(self.llm)))
            except Exception as exc:  # noqa: BLE001 (raised again in the caller)
                self.send(("called", token, False, f"{type(exc).__name__}: {exc}"))
        elif kind == "shutdown":
            return False
        return True

    def _send_outputs(self) -> None:
        from corerun.server.served import read_stats

        last_stats = None
        while True:
            try:
                items = [self.box.get(timeout=STATS_PERIOD_S)]
            except queue.Empty:
                items = []
            while items and len(items) < _BATCH:
                try:
                    items.append(self.box.get_nowait())
                except queue.Empty:
                    break
            done = _DONE in items
            items = [_portable(x) for x in items if x is not _DONE]
            try:
                if items:
                    self.send(("out", items))
                stats = read_stats(self.llm.engine)
                if stats != last_stats:
                    self.send(("stats", stats))
                    last_stats = stats
                if done:
                    self.send(("bye",))
                    return
            except (OSError, ValueError):  # the pipe is closed: nobody is left to read
                return


def _portable(item: tuple[str, Any]) -> tuple[str, Any]:
    """An exception the engine loop handed a request, as one any process can unpickle."""
    rid, out = item
    if isinstance(out, BaseException):
        from corerun.errors import StepError

        return rid, StepError(f"{type(out).__name__}: {out}")
    return item
