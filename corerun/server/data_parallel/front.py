"""``server.data_parallel_size`` replicas behind one API server: :class:`DataParallelEngine`.

Each replica is an :class:`~corerun.llm.LLM` in its own process (started as ``distributed.start_method``
says: ``spawn``, or ``forkserver``, which imports corerun and torch once for all replicas), with its own
KV cache and, where the configuration asks for one, its own tensor-parallel group; on CUDA each gets its
own slice of the visible devices.  The server tokenises, validates and renders as it does for one engine, then
:class:`~corerun.server.data_parallel.router.Router` picks the replica; outputs come back over the
replica's pipe to the request's stream.  A replica that dies fails only the requests it held; the
others keep serving, and ``/health`` names it.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import weakref
from collections import OrderedDict
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

from corerun.engine.loop import RequestStream
from corerun.errors import ConfigError, EngineClosedError, RequestError
from corerun.server.data_parallel.client import ReplicaClient
from corerun.server.data_parallel.router import Router
from corerun.server.served import EngineStats, ServedEngine

logger = logging.getLogger("corerun.server")

_REMEMBERED = 1 << 16  # requests whose replica is remembered for /metrics (the newest)
_LIVE: "weakref.WeakSet[DataParallelEngine]" = weakref.WeakSet()


@atexit.register
def _stop_live() -> None:
    for front in list(_LIVE):
        front.shutdown()


class DataParallelEngine(ServedEngine):
    """``config.server.data_parallel_size`` replicas of the engine ``config`` describes, started and loaded
    when this returns (a replica that fails to load stops the others and raises ``CorerunError``)."""

    def __init__(self, config: Any, *, slack_tokens: int = 2048) -> None:
        size = config.server.data_parallel_size
        if size < 1:
            raise ConfigError(f"server.data_parallel_size: {size}; give 1 or more replicas")
        if config.distributed.init_method is not None:
            raise ConfigError(f"distributed.init_method: {config.distributed.init_method!r} with server."
                              f"data_parallel_size={size}; each replica starts its own workers on this host, "
                              "so leave init_method unset (or serve one replica per launched group)")
        if config.lora.enabled:
            raise ConfigError(f"lora.enabled with server.data_parallel_size={size}: data-parallel replicas do not "
                              "serve LoRA adapters yet; serve them with one replica (data_parallel_size: 1)")
        self.config = config
        ctx = multiprocessing.get_context(config.distributed.start_method)
        if config.distributed.start_method == "forkserver":  # imported once, in the server every replica forks from
            ctx.set_forkserver_preload(["corerun.llm", "corerun.server.data_parallel.replica"])
        devices = _device_slices(config, size)
        self.replicas = [ReplicaClient(i, config, ctx, devices[i]) for i in range(size)]
        self._closed = False
        self._sent_to: OrderedDict[str, int] = OrderedDict()  # request id -> replica (read by /metrics at its end)
        _LIVE.add(self)
        try:
            for r in self.replicas:  # all load at once
                r.start()
            infos = [r.wait_ready() for r in self.replicas]
        except BaseException:
            self.shutdown()
            raise
        first = infos[0]
        self.model_dir = Path(first["model_dir"])
        self.max_model_len = first["max_model_len"]
        self.kv_tokens = min(i["kv_tokens"] for i in infos)
        self.engine_labels = [str(i) for i in range(size)]
        self.router = Router(first["block_size"], slack_tokens=slack_tokens)
        logger.info("data parallel: %d replicas (pids %s)", size, ", ".join(str(r.pid) for r in self.replicas))

    @cached_property
    def tokenizer(self) -> Any:  # type: ignore[override]
        if self.config.skip_tokenizer_init:
            return None
        from corerun.engine.input_processor import load_tokenizer

        return load_tokenizer(self.model_dir)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @cached_property
    def model_pooling(self) -> Any:
        from corerun.engine.pooling import read_model_pooling

        return read_model_pooling(self.model_dir)

    # ------------------------------------------------------------ requests
    async def add_request_async(self, prompt: list[int], params: Any, request_id: str, final_only: bool = False,
                                lora_request: Any = None) -> RequestStream:
        if self._closed:
            raise EngineClosedError("the engine was shut down")
        if any(r.holds(request_id) for r in self.replicas):
            raise RequestError(f"request_id {request_id!r} is already in use")
        loads = [r.outstanding if r.serving else None for r in self.replicas]
        try:
            chosen = self.router.choose(prompt, loads)
        except LookupError:
            raise EngineClosedError("no data-parallel replica is serving: "
                                    + "; ".join(r.lost or f"replica {r.index} closing" for r in self.replicas)) from None
        self._sent_to[request_id] = chosen
        while len(self._sent_to) > _REMEMBERED:
            self._sent_to.popitem(last=False)
        return await self.replicas[chosen].add(prompt, params, request_id, final_only, lora_request)

    def engine_of(self, request_id: str) -> int | None:
        return self._sent_to.get(request_id)

    def abort(self, request_ids: Sequence[str], wait: bool = False) -> None:
        for r in self.replicas:
            r.abort(request_ids)

    def num_waiting(self) -> int:
        return sum(r.waiting for r in self.replicas if r.serving)

    def stats(self) -> list[EngineStats | None]:
        return [r.stats if r.serving else None for r in self.replicas]

    def health(self) -> tuple[bool, dict[str, Any]]:
        replicas = []
        for r in self.replicas:
            entry: dict[str, Any] = {"engine": r.index, "pid": r.pid, "serving": r.serving,
                                     "requests": len(r.held()), "outstanding_tokens": r.outstanding}
            if r.lost is not None:
                entry["error"] = r.lost
            replicas.append(entry)
        up = sum(e["serving"] for e in replicas)
        status = "ok" if up == len(replicas) else ("degraded" if up else "down")
        return up > 0, {"status": status, "replicas": replicas}

    def shutdown(self) -> None:
        """Stop every replica (each aborts what it still runs; one that does not exit is killed). Safe twice."""
        self._closed = True
        for r in self.replicas:
            r.closing = True
        for r in self.replicas:
            r.shutdown()


def _device_slices(config: Any, size: int) -> list[str | None]:
    """Each replica's ``CUDA_VISIBLE_DEVICES`` on a CUDA host: consecutive slices of the visible devices,
    one per rank of its group; None on CPU (or when the devices are too few to split: then all share)."""
    if config.device == "cpu":
        return [None] * size
    try:
        import torch

        count = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 (no CUDA build)
        count = 0
    if count == 0:
        return [None] * size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(count)]
    per = config.tensor_parallel_size * getattr(config, "pipeline_parallel_size", 1)
    if len(ids) < per * size:
        logger.warning("data parallel: %d replicas of %d device(s) each want %d devices, %d are visible: the "
                       "replicas share them", size, per, per * size, len(ids))
        return [None] * size
    return [",".join(ids[i * per:(i + 1) * per]) for i in range(size)]
