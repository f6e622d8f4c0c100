"""Per-layer sliding windows and logit soft-capping in the attention conformance suite: the torch backend
passes its two checks against the float64 reference, and backends that get either wrong are rejected."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from corerun.attention.torch_backend import TorchAttentionBackend
from corerun.conformance import run
from corerun.errors import UnsupportedError
from corerun.plugin.capabilities import AttentionCapabilities
from corerun.protocols.attention import AttentionSpec
from tests.broken_impls.attention import NaiveAttentionBackend

KEYWORD = "fp32 and (sliding_window or soft_cap)"


class IgnoresWindow(TorchAttentionBackend):
    """Broken: declares sliding windows, attends over the whole context on every layer."""

    name = "ignores-window"

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self.spec = replace(spec, sliding_windows=())


class WindowOneTooWide(TorchAttentionBackend):
    """Broken: one key more than the window (``p - window .. p``)."""

    name = "window-one-too-wide"

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self.spec = replace(spec, sliding_windows=tuple(None if w is None else w + 1 for w in spec.sliding_windows))


class IgnoresSoftCap(TorchAttentionBackend):
    """Broken: declares soft-capping, leaves the scores uncapped."""

    name = "ignores-soft-cap"

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self.spec = replace(spec, logits_soft_cap=None)


class ClaimsNothingBuildsAnything(NaiveAttentionBackend):
    """Broken: declares neither, but builds for any spec (and attends full and uncapped)."""

    name = "builds-anything"

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec


def _failed(results: list) -> dict[str, str]:
    return {r.check: r.reason for r in results if r.failed}


def test_torch_backend_passes_sliding_and_soft_cap() -> None:
    results = run("attention", "torch", keyword=KEYWORD)
    assert {r.check for r in results if r.outcome == "passed"} == {"sliding_window", "soft_cap"}
    assert not _failed(results)


@pytest.mark.parametrize(
    ("impl", "check", "text"),
    [
        (IgnoresWindow, "sliding_window", "sliding window of"),
        (WindowOneTooWide, "sliding_window", "sliding window of"),
        (IgnoresSoftCap, "soft_cap", "soft cap 1.5"),
        (ClaimsNothingBuildsAnything, "sliding_window", "must raise corerun.UnsupportedError"),
    ],
    ids=["ignores-window", "window-one-too-wide", "ignores-soft-cap", "builds-anything"],
)
def test_broken_backend_rejected(impl: type, check: str, text: str) -> None:
    failed = _failed(run("attention", factory=impl, keyword=KEYWORD))
    assert check in failed, f"{impl.name}: {check} passed"
    assert text in failed[check], failed[check]


def test_undeclared_windows_and_caps_named_in_the_refusal() -> None:
    caps = AttentionCapabilities(dtypes=frozenset({"float32"}))
    spec = AttentionSpec(4, 2, 16, torch.float32, 16, torch.device("cpu"), sliding_windows=(None, 8), logits_soft_cap=50.0)
    assert caps.check(spec) == ["sliding-window attention (window 8) not supported",
                                "attention logit soft-capping (cap 50) not supported"]
    with pytest.raises(UnsupportedError, match="window 8"):
        NaiveAttentionBackend(spec)
