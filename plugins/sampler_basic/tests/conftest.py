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
def _seeded_default_generator() -> Iterator[None]:
    """A fixed default generator for every test (one torch thread comes from the root conftest)."""
    torch.manual_seed(1234)
    yield
