"""``corerun serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the shared engine loop.

Needs the ``serve`` extra (``pip install corerun[serve]``: fastapi, uvicorn, prometheus-client);
importing this package does not import them, :func:`corerun.server.run.serve` does.
"""
