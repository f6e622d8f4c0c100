"""Architecture v3's size rule, held: no module under ``corerun/`` is over 450 lines except model code
(``corerun/models/``), and the engine (``engine/llm_engine.py``) stays under 350. A file that grows past
its bound has taken on a second job; the message names the file and its length."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 450
ENGINE_LIMIT = 350


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_module_outside_the_models_is_over_450_lines() -> None:
    over = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / "corerun").rglob("*.py"))
        if "models" not in p.relative_to(ROOT / "corerun").parts[:1] and (n := _lines(p)) > LIMIT
    }
    assert not over, f"over {LIMIT} lines (split by job): {over}"


def test_the_engine_is_under_350_lines() -> None:
    n = _lines(ROOT / "corerun" / "engine" / "llm_engine.py")
    assert n < ENGINE_LIMIT, f"corerun/engine/llm_engine.py has {n} lines; the engine does one job in under {ENGINE_LIMIT}"
