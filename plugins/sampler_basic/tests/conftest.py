"""Fixtures of the basic sampler's tests."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Iterator, Sequence

import pytest
import torch

from corerun.protocols import SamplingMetadata
from corerun.sampling_params import SamplingParams


def metadata(params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]] | None = None) -> SamplingMetadata:
    """A step's metadata; prompts empty, outputs empty unless given."""
    n = len(params)
    return SamplingMetadata(
        params=list(params),
        prompt_token_ids=[[] for _ in range(n)],
        output_token_ids=list(outputs) if outputs is not None else [[] for _ in range(n)],
    )


@pytest.fixture
def ref() -> SimpleNamespace:
    return SimpleNamespace(metadata=metadata)


@pytest.fixture(autouse=True)
def _seeded_single_thread() -> Iterator[None]:
    """Fixed default generator; one torch thread (these tensors are tiny, and on a busy machine a thread
    pool costs milliseconds per op), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    yield
    torch.set_num_threads(threads)
