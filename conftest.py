"""Settings shared by every test of the repository (core and plugins)."""

from __future__ import annotations

from typing import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """The tests use tiny tensors: one intra-op thread is as fast on an idle machine and far faster on a
    busy one, where a thread pool's spin-waiting costs milliseconds per op."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
