"""An engine for a test in one call (:func:`make_llm`), and the check that it was left with nothing
held (:func:`assert_idle`).

    llm = make_llm(model_dir, scheduler={"max_num_seqs": 2})   # CPU, float32, torch attention, 64 blocks of 4
    outs = llm.generate(prompts, params)
    assert_idle(llm)                                            # no request left, every KV block free
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

#: What :func:`make_llm` passes to :class:`corerun.LLM` unless told otherwise: small enough for a CPU,
#: exact enough to compare with a float32 or float64 reference, and with few blocks so that a leak shows.
TEST_DEFAULTS: dict[str, Any] = {
    "device": "cpu",
    "dtype": "float32",
    "attention": "torch",
    "kv_cache": {"block_size": 4, "num_blocks": 64},
    "scheduler": {"max_model_len": 128},
}


def make_llm(model: str | Path | None = None, **overrides: Any) -> Any:
    """A :class:`corerun.LLM` for a test: ``model`` (a folder or Hub id; by default a tiny random Llama
    without tokenizer, written once per process, so prompts are token ids) with :data:`TEST_DEFAULTS`.

    ``overrides`` are ``LLM`` keywords.  A section given as a dict (``kv_cache``, ``scheduler``,
    ``server``, ...) is merged key by key into the default one, so ``make_llm(d, scheduler={"max_num_seqs":
    2})`` keeps ``max_model_len`` 128; any other value replaces the default.  Shut the engine down
    (``llm.shutdown()`` or ``with make_llm(...) as llm:``) when the test is done with it.
    """
    from corerun.llm import LLM

    config = {key: dict(value) if isinstance(value, dict) else value for key, value in TEST_DEFAULTS.items()}
    for key, value in overrides.items():
        merge = isinstance(value, dict) and isinstance(config.get(key), dict)
        config[key] = {**config[key], **value} if merge else value
    return LLM(model=str(model) if model is not None else str(_tiny_llama()), **config)


@lru_cache(maxsize=1)
def _tiny_llama() -> Path:
    from corerun.testing.tiny_models import make_tiny_model

    parent = Path(tempfile.mkdtemp(prefix="corerun-make-llm-"))
    atexit.register(shutil.rmtree, parent, ignore_errors=True)
    return make_tiny_model(parent, arch="llama")


def leftovers(llm: Any) -> list[str]:
    """What ``llm`` (a :class:`corerun.LLM` or its ``LLMEngine``) still holds, one phrase each; ``[]`` when idle.

    Counted: requests running or waiting in the scheduler, requests the engine has not released
    (their outputs not yet taken), a step launched and not collected (asynchronous scheduling),
    KV-cache blocks in use, in the target model's cache and in the draft model's (speculative decoding
    with a draft model), and the draft model's copies of requests' tokens it still keeps.  A block a
    finished request left in the prefix cache counts as free: the next request may evict it.
    """
    engine = getattr(llm, "engine", llm)
    found: list[str] = []
    scheduler = engine.scheduler
    for name, seqs in (("running", list(scheduler.running)), ("waiting", list(scheduler.waiting))):
        if seqs:
            found.append(f"{len(seqs)} request(s) {name}: {_ids(s.request_id for s in seqs)}")
    held = list(engine.requests)
    if held:
        found.append(f"{len(held)} request(s) not released: {_ids(held)}")
    if engine.queue.in_flight is not None:
        found.append("a step launched and not collected")
    caches = [("KV cache", engine.kv)]
    proposer = engine.proposer
    draft_runner = getattr(proposer, "runner", None)
    if draft_runner is not None:
        caches.append(("draft model's KV cache", draft_runner.kv_manager))
    for name, kv in caches:
        stats = kv.stats()
        used = stats.num_blocks - stats.num_free_blocks
        if used:
            found.append(f"{used} of {stats.num_blocks} blocks of the {name} in use")
    kept = list(getattr(proposer, "seqs", None) or ())
    if kept:
        found.append(f"{len(kept)} draft-model sequence(s) kept, for seq id(s) {_ids(kept)}")
    return found


def assert_idle(llm: Any, timeout: float = 0.0) -> None:
    """Assert that ``llm`` (a :class:`corerun.LLM` or its ``LLMEngine``) holds nothing: no request
    running, waiting or unreleased, no step in flight, every KV-cache block free (:func:`leftovers`).

    ``timeout`` > 0 polls for up to that many seconds first, for an engine another thread drives (a
    server's engine loop finishing a request it has already answered).  The ``AssertionError`` lists
    everything still held.
    """
    end = time.monotonic() + timeout
    while True:
        left = leftovers(llm)
        if not left or time.monotonic() >= end:
            break
        time.sleep(0.02)
    if left:
        waited = f" after waiting {timeout:g} s" if timeout > 0 else ""
        raise AssertionError(f"engine not idle{waited}: " + "; ".join(left))


def _ids(ids: Any, shown: int = 8) -> str:
    ids = [repr(i) for i in ids]
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return ", ".join(ids[:shown]) + more


__all__ = ["TEST_DEFAULTS", "assert_idle", "leftovers", "make_llm"]
