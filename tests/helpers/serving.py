"""The real HTTP server (uvicorn on a free 127.0.0.1 port, in a thread) around an LLM on a tiny model.

    with running_server(llm) as url:      # "http://127.0.0.1:PORT"
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from tests.helpers.tiny_models import make_tiny_model
from tests.helpers.tiny_tokenizer import add_tiny_tokenizer

ENGINE = dict(device="cpu", dtype="float32", attention="torch", sampler="full", seed=0)
#: What the serving tests add to ``corerun.testing.make_llm``'s defaults: ``make_llm(folder, **SERVING, ...)``.
SERVING = dict(sampler="full", seed=0)


def tiny_chat_model(tmp_dir: Path) -> Path:
    """A tiny random Llama with the tiny BPE tokenizer and a chat template."""
    return add_tiny_tokenizer(make_tiny_model(tmp_dir, "llama"))


@contextmanager
def running_server(llm: Any) -> Iterator[str]:
    """Serve ``llm`` for the body; on exit the server stops as on SIGTERM (the engine loop is shut down)."""
    with server_and_url(llm) as (_, url):
        yield url


@contextmanager
def server_and_url(llm: Any) -> Iterator[tuple[Any, str]]:
    """``running_server`` that also yields the ``uvicorn.Server`` (``server.should_exit = True``: as SIGTERM)."""
    from corerun.server.run import bind, make_server

    sock = bind()
    server = make_server(llm)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server thread died while starting")
        time.sleep(0.02)
    try:
        yield server, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


def http(url: str, body: Any = None, *, raw: bytes | None = None, method: str | None = None) -> tuple[int, Any]:
    """``(status, parsed JSON or text)`` of one request (no client-side retries, errors returned, not raised)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample (summed over label sets matching ``labels``)."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        series, _, rest = head.partition("{")
        if series != name:
            continue
        got = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv)
        if all(got.get(k, "").strip('"') == v for k, v in labels.items()):
            total += float(value)
            found = True
    if not found:
        raise KeyError(f"no sample {name}{labels} in /metrics")
    return total

