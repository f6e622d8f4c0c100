"""Running the app under uvicorn: on a host/port, or on a socket already bound (tests)."""

from __future__ import annotations

import logging
import socket
from typing import Any

logger = logging.getLogger("corerun.server")

_MISSING = (
    "corerun serve needs the serve extra: pip install 'corerun[serve]' (fastapi, uvicorn, prometheus-client); "
    "scripts/setup.sh installs it"
)


def check_installed() -> None:
    """Raise ImportError with the install line when the serve extra is missing."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"{_MISSING} ({exc})") from None


CUTOFF_GRACE_S = 5.0  # after the app has ended its clients' requests, uvicorn waits this long before cancelling


def make_server(llm: Any, *, host: str | None = None, port: int | None = None, log_level: str = "warning") -> Any:
    """A ``uvicorn.Server`` for ``llm`` (not started). SIGTERM / SIGINT stop it gracefully: no new
    connections or requests, in-flight requests get ``server.shutdown_timeout_s`` to finish, then each
    client still waiting gets an explicit error (an error event then ``[DONE]`` on a stream, a JSON 503
    otherwise) and its engine requests are aborted; then the engine is shut down."""
    check_installed()
    import uvicorn

    from corerun.server.app import build_app
    from corerun.server.connections import guarded_protocol

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            app.state.serving.begin_shutdown(cfg.shutdown_timeout_s)
            await super().shutdown(sockets)

    cfg = llm.config.server
    app = build_app(llm)
    config = uvicorn.Config(
        app, host=host if host is not None else cfg.host, port=port if port is not None else cfg.port,
        log_level=log_level, timeout_graceful_shutdown=cfg.shutdown_timeout_s + CUTOFF_GRACE_S, lifespan="on",
        access_log=log_level in ("info", "debug"), http=guarded_protocol(cfg.max_connections, cfg.read_timeout_s),
    )
    return Server(config)


def bind(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening socket (port 0: a free port; read it back with ``sock.getsockname()[1]``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def serve(llm: Any, *, host: str | None = None, port: int | None = None, log_level: str = "info") -> None:
    """Serve ``llm`` until SIGTERM / SIGINT (blocking)."""
    server = make_server(llm, host=host, port=port, log_level=log_level)
    server.run()
