"""``corerun serve`` as a process: configuration from --set, and a graceful stop on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from tests.helpers.engine_testing import no_hang  # noqa: E402,F401
from tests.helpers.serving import http, tiny_chat_model  # noqa: E402


def start_serve(cmd: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, list[str]]:
    """Start ``cmd`` (``corerun serve ... --port 0``: the server binds a port the kernel picks, so no other
    process, a parallel test worker's included, can take it between a probe and the bind) and read its
    stderr up to uvicorn's startup line: the process, its URL from that line, and the lines read so far."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"})
    lines = []
    for line in proc.stderr:  # (the test deadline bounds this)
        lines.append(line)
        if found := re.search(r"Uvicorn running on (http://127\.0\.0\.1:[1-9]\d*)", line):
            return proc, found.group(1), lines
    proc.wait()
    raise AssertionError(f"corerun serve exited with {proc.returncode} before it listened: {''.join(lines)}")


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    while True:  # (the test deadline bounds this)
        if proc.poll() is not None:
            raise AssertionError(f"corerun serve exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if http(url + "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)


def test_serve_command_stops_gracefully_on_sigterm(tmp_path: Any) -> None:
    folder = tiny_chat_model(tmp_path)
    cmd = [sys.executable, "-m", "corerun", "serve", "--model", str(folder), "--port", "0", "--device", "cpu",
           "--dtype", "float32", "--attention", "torch", "--served-model-name", "tiny",
           "--set", "kv_cache.num_blocks=64", "--set", "kv_cache.block_size=4", "--set", "server.shutdown_timeout_s=60",
           "--log-level", "info"]
    proc, url, started = start_serve(cmd)
    try:
        _wait_healthy(url, proc)
        assert http(url + "/v1/models")[1]["data"][0]["id"] == "tiny"
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        with client.completions.with_streaming_response.create(
            model="tiny", prompt="hello", max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True},
        ) as resp:
            lines = resp.iter_lines()
            first = next(x for x in lines if x)
            proc.send_signal(signal.SIGTERM)  # mid-stream: the request in flight still finishes
            rest = [x for x in lines if x]
        data = [first, *rest]
        assert data[-1] == "data: [DONE]"
        chunks = [json.loads(x.removeprefix("data: ")) for x in data[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # uvicorn ends by re-raising the signal it caught, once the shutdown is done (the engine released)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        log = "".join(started) + proc.stderr.read()
        assert "Application shutdown complete" in log and "Traceback" not in log, log
        with pytest.raises(OSError):  # it no longer listens
            http(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
