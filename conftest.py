"""Settings shared by every test of the repository (core and plugins)."""

from __future__ import annotations

import os
from typing import Iterator

import pytest


def _triton_interpreter_without_cuda() -> None:
    """Triton fixes interpreter-or-compiled when it is first imported, and tests import it early and
    in any order (transformers does): without CUDA, ask for the interpreter before anything loads it."""
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"


_triton_interpreter_without_cuda()


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """The tests use tiny tensors: one intra-op thread is as fast on an idle machine and far faster on a
    busy one, where a thread pool's spin-waiting costs milliseconds per op."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``pytest -n auto --dist loadfile`` (the README's test command): one worker more than the machine has cores.  Much
    of the suite waits on child processes (servers, tensor- and pipeline-parallel ranks, pip installs of
    throw-away plugins) with one torch thread per worker, and the extra worker fills that time: on the
    2-core development machine the suite takes about 9 minutes with three workers, 11.5 with two and
    15 in one process."""
    return (os.cpu_count() or 1) + 1
