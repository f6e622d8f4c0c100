"""One part's results file, rewritten as the part goes, so a part cut short still leaves what it measured.

Every Python part of ``run.sh`` writes one JSON document through :class:`PartReport`::

    {"part": "kv-profile", "status": "running", "running": "triton: build the engine",
     "checks": [{"name": "write the model", "ok": true, "seconds": 4.1}, ...], "results": {...}}

The file is replaced (write, then rename) when a check starts and when it ends: ``running`` names the
check a killed part was in.  SIGTERM (what ``timeout`` sends first) marks the document ``killed`` and
exits at once.  ``--dry-run`` parts call :meth:`PartReport.rehearse` with the checks they would run;
``CORERUN_GPU_DRY_HANG=TEXT`` makes a rehearsed check whose name contains TEXT hang, so the time
limits and the reporting of a hung part can be exercised without a GPU.

    python benchmarks/gpu/part_report.py summary RESULTS.json    # the one line run.sh prints per part
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

HANG_ENV = "CORERUN_GPU_DRY_HANG"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class PartReport:
    """The results document of one part at ``path``; ``results`` is the part's own data."""

    def __init__(self, path: Path, part: str, *, dry_run: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._start = time.perf_counter()
        self.results: dict[str, Any] = {}
        self.doc: dict[str, Any] = {
            "part": part, "dry_run": dry_run, "status": "running", "running": None, "started": _now(),
            "seconds": 0.0, "pid": os.getpid(), "checks": [], "results": self.results,
        }
        self._open: dict[str, Any] | None = None
        self.on_kill: Callable[[], None] | None = None  # adds to the document before a SIGTERM exit
        if _is_main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self.save()

    # ------------------------------------------------------------------ writing
    def save(self) -> None:
        """Write the document now (to a temporary name, then renamed over the file)."""
        self.doc["seconds"] = round(time.perf_counter() - self._start, 2)
        self.doc["updated"] = _now()
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=2, default=str))
        os.replace(tmp, self.path)

    @contextmanager
    def check(self, name: str, *, catch: bool = False) -> Iterator[dict[str, Any]]:
        """One named check: ``running`` names it while the body runs; the body may fill the entry
        (``entry["ok"] = False`` for a wrong result).  An exception marks the check failed with the
        error and is re-raised, or swallowed with ``catch=True`` (the part goes on with the next)."""
        entry: dict[str, Any] = {"name": name, "ok": None}
        self.doc["checks"].append(entry)
        self.doc["running"] = name
        self._open = entry
        self.save()
        print(f"-- {name}", flush=True)
        start = time.perf_counter()
        try:
            yield entry
        except Exception as exc:
            entry["ok"] = False
            entry["error"] = f"{type(exc).__name__}: {exc}"
            print(f"   failed: {entry['error']}", file=sys.stderr, flush=True)
            if not catch:
                raise
        else:
            if entry["ok"] is None:
                entry["ok"] = True
        finally:
            entry["seconds"] = round(time.perf_counter() - start, 3)
            self.doc["running"] = None
            self._open = None
            self.save()

    def finish(self, ok: bool | None = None) -> int:
        """Mark the part done; ``ok`` defaults to every check having passed.  Returns the exit status."""
        if ok is None:
            ok = all(c.get("ok") is not False for c in self.doc["checks"])
        self.doc["status"] = "passed" if ok else "failed"
        self.save()
        return 0 if ok else 1

    def rehearse(self, names: Iterable[str]) -> int:
        """The dry run: each check is entered and left without work (one named by ``$CORERUN_GPU_DRY_HANG`` hangs)."""
        for name in names:
            with self.check(name) as entry:
                entry["dry_run"] = True
                self.rehearse_hang(name)
        return self.finish()

    def rehearse_hang(self, name: str) -> None:
        """In a dry run, hang here when ``$CORERUN_GPU_DRY_HANG`` is part of ``name``."""
        hang = os.environ.get(HANG_ENV)
        if self.doc["dry_run"] and hang and hang in name:
            time.sleep(3600)

    # ------------------------------------------------------------------ killed
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        running = self.doc.get("running")
        self.doc["status"] = "killed"
        self.doc["killed_in"] = running
        if self._open is not None:
            self._open["ok"] = False
            self._open["error"] = "killed by SIGTERM (the part's time limit) while this check ran"
        try:
            if self.on_kill is not None:
                self.on_kill()
            self.save()
        finally:
            print(f"killed by SIGTERM while running: {running}", file=sys.stderr, flush=True)
            os._exit(128 + signum)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# ---------------------------------------------------------------------- summary
def summary_line(path: Path) -> str:
    """One line about a results file: checks passed / failed, and the check a killed part was in."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return f"no results file {Path(path).name} (the part stopped before writing one; see its log)"
    except (OSError, ValueError) as exc:
        return f"results file {Path(path).name} unreadable: {exc}"
    checks = doc.get("checks", [])
    passed = sum(1 for c in checks if c.get("ok") is True)
    failed = [c["name"] for c in checks if c.get("ok") is False]
    parts = [f"{doc.get('status', '?')}: {passed}/{len(checks)} checks passed"]
    if failed:
        shown = ", ".join(failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
        parts.append(f"failed: {shown}")
    hung = doc.get("killed_in") or (doc.get("running") if doc.get("status") == "running" else None)
    if hung:
        parts.append(f"stopped in: {hung}" + (f" ({doc['engine_step']})" if doc.get("engine_step") else ""))
    return "; ".join(parts)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "summary":
        print("usage: part_report.py summary RESULTS.json", file=sys.stderr)
        return 2
    print(summary_line(Path(argv[1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
