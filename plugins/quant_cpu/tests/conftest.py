"""Every test here needs the kernel library: built once (or found built) per session, else skipped with the reasons."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def built() -> None:
    from corerun_quant_cpu import kernels

    reasons = kernels.load()
    if reasons:
        pytest.skip("; ".join(reasons))
