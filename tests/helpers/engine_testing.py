"""Shared pieces of the engine-level tests: Hugging Face's greedy reference and a deadline against hangs."""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch

from corerun.testing import hf_greedy  # noqa: F401  (moved there, public for plugin tests)

NO_HANG_S = 180


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail (instead of hanging the test run) if the body takes longer than ``seconds``."""

    def expire(*_: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s: the engine hangs")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(autouse=True)
def no_hang() -> Iterator[None]:
    """Fail the test, never hang the run, if the engine stops making progress."""
    with deadline(NO_HANG_S):
        yield
