"""Ranks launched as torchrun would: this process is rank 0, the others ``python -m corerun.executor.worker``."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import yaml

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def launched_ranks(config: dict[str, Any], folder: Path, monkeypatch: Any, world: int = 2) -> Iterator[Path]:
    """Write ``config`` (with ``init_method: env://``) to ``folder``, start ranks 1..world-1 on it and set this
    process up as rank 0; yields the config file.  On exit each started rank must have exited 0 (its log shown)."""
    path = folder / "launched.yaml"
    path.write_text(yaml.safe_dump({**config, "distributed": {**config.get("distributed", {}), "init_method": "env://"}}))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(sock.getsockname()[1]), "WORLD_SIZE": str(world)}
    logs = [open(folder / f"rank{r}.log", "w") for r in range(1, world)]
    workers = [
        subprocess.Popen([sys.executable, "-m", "corerun.executor.worker", "--config", str(path)], cwd=ROOT,
                         env={**os.environ, **env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=log, stderr=subprocess.STDOUT)
        for r, log in zip(range(1, world), logs)
    ]
    try:
        for k, v in {**env, "RANK": "0", "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(k, v)
        yield path
        for r, w in enumerate(workers, start=1):
            assert w.wait(timeout=60) == 0, (folder / f"rank{r}.log").read_text()
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        for log in logs:
            log.close()
