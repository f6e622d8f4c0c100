"""LoRA adapters served as models: ``--lora-modules name=path`` at start, listed in ``/v1/models`` with the
base model as ``parent``, a request's ``model`` field naming the adapter it runs under; and, behind
``--enable-lora-runtime-updating``, ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (vLLM's
bodies: ``{"lora_name": ..., "lora_path": ...}``).  Those routes are under ``/v1``, so they need the API
key when one is set, like every other.

An adapter is read and checked against the model when it is added (a bad folder is a 400 naming what
is wrong), not when its first request arrives.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from corerun.errors import RequestError
from corerun.lora.request import LoRARequest
from corerun.server import protocol as P


class Adapters:
    """The adapters a server serves, by name; ``parent``: the base model's served name."""

    def __init__(self, engine: Any, parent: str, modules: dict[str, str], runtime_updating: bool) -> None:
        self.engine, self.parent, self.runtime_updating = engine, parent, runtime_updating
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._created: dict[str, int] = {}
        for name, path in modules.items():
            self.add(name, path)

    def add(self, name: str, path: str) -> LoRARequest:
        """Read and check the adapter at ``path``, served as ``name``; raises ``APIError(400)`` naming the problem."""
        if not isinstance(name, str) or not name.strip():
            raise P.APIError(400, f"lora_name must be a non-empty string, got {name!r}", param="lora_name")
        if not isinstance(path, str) or not path.strip():
            raise P.APIError(400, f"lora_path must be the adapter's folder, got {path!r}", param="lora_path")
        with self._lock:
            if name == self.parent or name in self.by_name:
                raise P.APIError(400, f"lora_name {name!r} is already served; unload it first or pick another name",
                                 param="lora_name")
            request = LoRARequest(name, next(self._ids), path)
            try:
                self.engine.add_lora(request)
            except RequestError as exc:
                raise P.APIError(400, str(exc), param="lora_path") from None
            self.by_name[name] = request
            self._created[name] = int(time.time())
            return request

    def remove(self, name: str) -> None:
        with self._lock:
            request = self.by_name.get(name)
            if request is None:
                raise P.APIError(404, f"lora_name {name!r} is not loaded; loaded: {sorted(self.by_name)}",
                                 param="lora_name", code="model_not_found")
            try:
                self.engine.remove_lora(request.lora_int_id)
            except RequestError as exc:
                raise P.APIError(400, str(exc), param="lora_name") from None
            del self.by_name[name]

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (``None``: the base model); 404 naming every served model."""
        if model is None or model == self.parent:
            return None
        request = self.by_name.get(model)
        if request is None:
            raise P.APIError(404, f"model {model!r} does not exist; this server serves {[self.parent, *sorted(self.by_name)]}",
                             param="model", code="model_not_found")
        return request

    def cards(self) -> list[dict[str, Any]]:
        """``/v1/models`` entries of the adapters (OpenAI's model object, vLLM's ``root`` and ``parent``)."""
        return [{"id": name, "object": "model", "created": self._created.get(name, 0), "owned_by": "corerun",
                 "root": r.lora_path, "parent": self.parent} for name, r in sorted(self.by_name.items())]


def add_lora_routes(app: FastAPI, adapters: Adapters, read_json: Any, cfg: Any) -> None:
    """``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: 404 naming the switch unless
    ``server.enable_lora_runtime_updating`` is on."""

    def body(data: Any, fields: tuple[str, ...]) -> dict[str, Any]:
        if not adapters.runtime_updating:
            raise P.APIError(404, "loading and unloading adapters at run time is off; start the server with "
                             "--enable-lora-runtime-updating (server.enable_lora_runtime_updating: true)",
                             code="lora_runtime_updating_disabled")
        if not isinstance(data, dict):
            raise P.APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise P.APIError(400, f"unknown field(s) {unknown}; this route takes {list(fields)}", param=unknown[0])
        return data

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request) -> JSONResponse:
        data = body(await read_json(request, cfg), ("lora_name", "lora_path"))
        lora = await asyncio.to_thread(adapters.add, data.get("lora_name"), data.get("lora_path"))
        return JSONResponse({"object": "lora_adapter", "lora_name": lora.lora_name, "lora_int_id": lora.lora_int_id})

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> JSONResponse:
        data = body(await read_json(request, cfg), ("lora_name", "lora_int_id"))
        await asyncio.to_thread(adapters.remove, data.get("lora_name"))
        return JSONResponse({"object": "lora_adapter", "lora_name": data.get("lora_name"), "unloaded": True})
