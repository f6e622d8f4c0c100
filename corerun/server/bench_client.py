"""Online benchmark of a running OpenAI-compatible server, in the style of vLLM's ``benchmark_serving``.

    corerun bench --url http://127.0.0.1:8000 --num-seqs 200 --request-rate 8 --max-concurrency 32
    python -m corerun.server.bench_client --url http://127.0.0.1:8000 --num-prompts 200 --request-rate inf

Requests of random token ids (``prompt`` as a token list, ``ignore_eos``, exact output lengths) go to
``/v1/completions`` with ``stream: true``; arrivals are a Poisson process at ``request_rate`` per second
(``inf``: all at once), at most ``max_concurrency`` in flight.  Per request it measures the time to
first token (TTFT), the gaps between streamed chunks (ITL), time per output token after the first
(TPOT) and end-to-end latency; the report gives their mean and percentiles, and request / token
throughput over the whole run.  Only the standard library is used (asyncio streams, HTTP/1.1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def _auth() -> str:
    """The ``Authorization`` header line for a server started with ``--api-key``: the key is read from
    ``CORERUN_API_KEY``, the variable ``corerun serve`` reads too; nothing when it is unset."""
    key = os.environ.get("CORERUN_API_KEY")
    return f"Authorization: Bearer {key}\r\n" if key else ""


async def _sse(url: str, body: dict[str, Any]) -> AsyncIterator[str]:
    """POST ``body`` as JSON and yield the ``data:`` payloads of the server-sent-event reply."""
    u = urlsplit(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port or 80)
    try:
        payload = json.dumps(body).encode()
        writer.write(
            f"POST {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nAccept: text/event-stream\r\n{_auth()}Connection: close\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        status = (await reader.readline()).decode().split(" ", 2)
        headers = {}
        while (line := (await reader.readline()).decode().strip()):
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        if len(status) < 2 or status[1] != "200":
            raise RuntimeError(f"HTTP {' '.join(status[1:]).strip()}: {(await reader.read(2000)).decode(errors='replace')}")
        buf = b""
        async for chunk in _body(reader, headers):
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.decode().splitlines():
                    if line.startswith("data: "):
                        yield line[6:]
    finally:
        writer.close()


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # CRLF
    while chunk := await reader.read(65536):
        yield chunk


async def one_request(url: str, model: str, prompt: list[int], output_len: int, temperature: float) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": temperature, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    res = RequestResult(ok=False, prompt_len=len(prompt))
    start = last = time.perf_counter()
    try:
        async for data in _sse(url.rstrip("/") + "/v1/completions", body):
            if data == "[DONE]":
                break
            msg = json.loads(data)
            if "error" in msg:
                raise RuntimeError(msg["error"].get("message"))
            now = time.perf_counter()
            if msg.get("choices") and msg["choices"][0].get("text"):
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
            if msg.get("usage"):
                res.output_len = msg["usage"]["completion_tokens"]
        res.e2e = time.perf_counter() - start
        res.ok = res.output_len > 0
        if not res.ok:
            res.error = "no tokens (or no usage) in the stream"
    except Exception as exc:  # noqa: BLE001 (reported per request)
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def _model_name(url: str) -> str:
    u = urlsplit(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port or 80)
    writer.write(f"GET /v1/models HTTP/1.1\r\nHost: {u.hostname}\r\n{_auth()}Connection: close\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"chunked" in head.lower():
        out, rest = b"", body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2 :]
        body = out
    status = head.split(b"\r\n", 1)[0].decode(errors="replace").split(" ", 2)
    if len(status) < 2 or status[1] != "200":
        hint = " (set CORERUN_API_KEY to the server's --api-key)" if status[1:2] == ["401"] else ""
        raise RuntimeError(f"GET /v1/models: HTTP {' '.join(status[1:]).strip()}{hint}: {body[:2000].decode(errors='replace')}")
    return json.loads(body)["data"][0]["id"]


async def run(url: str, *, num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
              request_rate: float, max_concurrency: int | None, seed: int, temperature: float, vocab: int,
              model: str | None = None, work: list[tuple[list[int], int]] | None = None) -> dict[str, Any]:
    """Run the benchmark; ``work`` (``(prompt token ids, output length)`` pairs) replaces the random workload."""
    rng = random.Random(seed)
    model = model or await _model_name(url)
    work = work if work is not None else make_work(num_prompts, input_len, output_len, vocab, rng)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(prompt: list[int], out: int) -> RequestResult:
        if gate is None:
            return await one_request(url, model, prompt, out, temperature)
        async with gate:
            return await one_request(url, model, prompt, out, temperature)

    start = time.perf_counter()
    tasks = []
    for prompt, out in work:
        tasks.append(asyncio.ensure_future(limited(prompt, out)))
        if math.isfinite(request_rate) and request_rate > 0:
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    return summarize(results, duration, model=model, url=url,
                     request_rate=request_rate if math.isfinite(request_rate) else "inf", max_concurrency=max_concurrency)


def make_work(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
              rng: random.Random) -> list[tuple[list[int], int]]:
    """Random token-id prompts (ids in [10, vocab)) with lengths drawn uniformly, and their output lengths."""
    return [([rng.randrange(10, vocab) for _ in range(rng.randint(*input_len))], rng.randint(*output_len))
            for _ in range(num_prompts)]


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    s = sorted(values)
    out = {"mean": statistics.fmean(s)}
    for p in PERCENTILES:  # nearest-rank percentile, in milliseconds below
        out[f"p{p}"] = s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]
    return out


def summarize(results: list[RequestResult], duration: float, **meta: Any) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    ms = lambda d: {k: v * 1000 for k, v in d.items()}  # noqa: E731
    return {
        **meta,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "ttft_ms": ms(_stats([r.ttft for r in ok])),
        "tpot_ms": ms(_stats([(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1])),
        "itl_ms": ms(_stats([x for r in ok for x in r.itl])),
        "e2e_ms": ms(_stats([r.e2e for r in ok])),
    }


def report(s: dict[str, Any]) -> str:
    lines = [
        f"server {s['url']}  model {s['model']}  request rate {s['request_rate']}/s  max concurrency {s['max_concurrency'] or 'none'}",
        f"completed {s['completed']}  failed {s['failed']}  in {s['duration_s']:.2f} s",
        f"request throughput     {s['request_throughput']:.2f} req/s",
        f"output throughput      {s['output_throughput']:.1f} tok/s",
        f"total token throughput {s['total_token_throughput']:.1f} tok/s",
        f"{'':18}{'mean':>10}" + "".join(f"{'p' + str(p):>10}" for p in PERCENTILES),
    ]
    for key, name in (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"), ("e2e_ms", "E2E (ms)")):
        d = s[key]
        lines.append(f"{name:18}{d['mean']:>10.1f}" + "".join(f"{d[f'p{p}']:>10.1f}" for p in PERCENTILES))
    for e in s["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model name [the server's first /v1/models entry]")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--input-len", default="32:128", help="MIN:MAX prompt tokens")
    ap.add_argument("--output-len", default="16:64", help="MIN:MAX output tokens")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (Poisson); inf: all at once")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--vocab", type=int, default=32000, help="token ids are drawn below this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    s = asyncio.run(run(a.url, num_prompts=a.num_prompts, input_len=_range(a.input_len), output_len=_range(a.output_len),
                        request_rate=a.request_rate, max_concurrency=a.max_concurrency, seed=a.seed,
                        temperature=a.temperature, vocab=a.vocab, model=a.model))
    print(json.dumps(s, indent=2) if a.json else report(s))
    return 0 if s["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())


def run_cli(url: str, num_prompts: int | None, ranges: list[Any], request_rate: float, max_concurrency: int | None,
            seed: int, temperature: float, as_json: bool) -> None:
    """``corerun bench --url``: the CPU defaults of the offline bench (16 requests, 32:128 in, 16:64 out)."""
    import click

    (lo_in, hi_in), (lo_out, hi_out) = [(r.lo, r.hi) if r is not None else d for r, d in zip(ranges, ((32, 128), (16, 64)))]
    s = asyncio.run(run(url, num_prompts=num_prompts or 16, input_len=(lo_in, hi_in), output_len=(lo_out, hi_out),
                        request_rate=request_rate, max_concurrency=max_concurrency, seed=seed, temperature=temperature,
                        vocab=_VOCAB_FLOOR))
    click.echo(json.dumps(s, indent=2) if as_json else report(s))
    if s["failed"]:
        raise click.ClickException(f"{s['failed']} of {s['failed'] + s['completed']} requests failed: {s['errors']}")


# token ids of the random prompts are drawn below this (every model served has at least these many)
_VOCAB_FLOOR = 256
