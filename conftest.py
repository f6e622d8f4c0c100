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
