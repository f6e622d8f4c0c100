"""Every test here needs the kernel library: built once (or found built) per session, else skipped with the reasons.
The folder's shared definitions (quant_cpu_cases.py) are importable (the suite may run with --import-mode=importlib)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session", autouse=True)
def built() -> None:
    from corerun_quant_cpu import kernels

    reasons = kernels.load()
    if reasons:
        pytest.skip("; ".join(reasons))
