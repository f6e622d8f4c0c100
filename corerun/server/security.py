"""Who may talk to the server: an ASGI guard in front of every route.

- ``Host`` must name the address the request arrived on (``localhost`` too when that is a loopback
  address) or one of ``server.allowed_hosts``: a web page that rebinds its own DNS name to 127.0.0.1
  sends its own name and is refused (403).
- A request carrying ``Origin`` (a browser's cross-origin request) is refused (403) unless the origin is
  the server's own or listed in ``server.allowed_origins``; listed origins get CORS headers, preflights
  included.
- With ``server.api_key`` set, every ``/v1`` route needs ``Authorization: Bearer <key>`` (401 otherwise).
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any, Awaitable, Callable

from corerun.server import protocol as P

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


def _host_name(host: str) -> str:
    """``"[::1]:8000"`` -> ``"::1"``, ``"Example.COM:80"`` -> ``"example.com"``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


class Guard:
    """The checks above, then ``app``; CORS headers on answers to allowed cross-origin requests."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, allowed_origins: list[str],
                 allowed_hosts: list[str]) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}
        self.hosts = {_host_name(h) for h in allowed_hosts}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        origin = headers.get("origin")
        cross = origin is not None and origin.rstrip("/").lower() != f"{scope.get('scheme', 'http')}://{host.lower()}"
        err = self._refusal(scope, headers, host, origin if cross else None)
        if err is not None:
            extra = [(b"www-authenticate", b"Bearer")] if err.status == 401 else []
            await P.send_error(send, err, extra + (_cors(origin) if cross and self._listed(origin) else []))
            return
        if not cross:
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:  # a preflight
            await _no_content(send, _cors(origin) + [
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers", b"authorization, content-type"),
                (b"access-control-max-age", b"600")])
            return

        async def send_cors(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + _cors(origin)}
            await send(message)

        await self.app(scope, receive, send_cors)

    def _listed(self, origin: str | None) -> bool:
        return origin is not None and ("*" in self.origins or origin.rstrip("/").lower() in self.origins)

    def _refusal(self, scope: dict, headers: dict[str, str], host: str, origin: str | None) -> P.APIError | None:
        """Why this request is refused, if it is (``origin``: a cross origin, None for same-origin requests)."""
        name = _host_name(host)
        local = (scope.get("server") or ("",))[0] or ""
        if "*" not in self.hosts and name not in self.hosts and name != _host_name(local) and not (
                name == "localhost" and _is_loopback(_host_name(local))):
            return P.APIError(403, f"Host: {host!r} is not this server's address ({local}); add the name to "
                              "server.allowed_hosts (--allowed-hosts) to serve it", code="host_not_allowed")
        if origin is not None and not self._listed(origin):
            return P.APIError(403, f"Origin: {origin!r} may not call this server; list it in server.allowed_origins "
                              "(--allowed-origins) to allow it", code="origin_not_allowed")
        if self.key is not None and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            auth = headers.get("authorization", "")
            given = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
            if not hmac.compare_digest(given, self.key):
                what = "no API key" if not given else "an incorrect API key"
                return P.APIError(401, f"Authorization: {what}; send 'Authorization: Bearer <key>' with the key this "
                                  "server was started with (--api-key / CORERUN_API_KEY)", code="invalid_api_key")
        return None


def _cors(origin: str | None) -> list[tuple[bytes, bytes]]:
    if origin is None:
        return []
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


async def _no_content(send: Any, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})
