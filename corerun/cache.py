"""Where corerun keeps what it makes once per machine: the converted default model, certificates of
conformance runs, plugins' compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$CORERUN_CACHE_DIR``, else ``$XDG_CACHE_HOME/corerun``, else ``~/.cache/corerun``."""
    if os.environ.get("CORERUN_CACHE_DIR"):
        return Path(os.environ["CORERUN_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "corerun"
    return Path.home() / ".cache" / "corerun"
