"""Shared pieces of the engine-level tests: Hugging Face's greedy reference and a deadline against hangs."""

from __future__ import annotations

import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

NO_HANG_S = 180


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Hugging Face transformers' greedy continuations of exactly ``max_tokens`` tokens (EOS ignored), float32."""
    from transformers import AutoModelForCausalLM

    from corerun.bench.hf_run import hf_with_dtype

    model = hf_with_dtype(AutoModelForCausalLM.from_pretrained, str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False)
            outs.append(gen[0, len(p):].tolist())
    return outs


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
