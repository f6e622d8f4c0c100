"""An attention backend named explicitly where it runs in an interpreter or emulator (its capabilities'
``emulated_on``; Triton on CPU) is used as asked, with one warning per process that it is slow."""

from __future__ import annotations

import logging
import uuid

import pytest

from corerun.plugin.capabilities import AttentionCapabilities
from tests.test_registry import Provides, Recorder, builtins_only, spec

SLOW = AttentionCapabilities(devices=frozenset({"cpu", "cuda", "meta"}), emulated_on=frozenset({"cpu"}))


@pytest.fixture
def name() -> str:
    """A backend name no other test used: the warning comes once per process for each name and device."""
    return f"interp-{uuid.uuid4().hex[:8]}"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_named_on_an_emulated_device_warns_once(name: str, caplog: pytest.LogCaptureFixture) -> None:
    reg = builtins_only((Provides(attention=[(name, Recorder(), {"capabilities": SLOW, "priority": 5})]), name, "corerun-interp"))
    with caplog.at_level(logging.WARNING):
        assert reg.select_attention(name, spec()).name == name
        assert reg.select_attention(name, spec()).name == name
    (warning,) = _warnings(caplog)
    assert warning.startswith(f"attention: '{name}' runs in an interpreter or emulator on cpu, not as native code")
    assert "attention: auto" in warning


def test_auto_native_devices_and_other_backends_do_not_warn(name: str, caplog: pytest.LogCaptureFixture) -> None:
    reg = builtins_only((Provides(attention=[(name, Recorder(), {"capabilities": SLOW})]), name, "corerun-interp"))
    with caplog.at_level(logging.WARNING):
        reg.select_attention("torch", spec())
        reg.select_attention("auto", spec())
        reg.select_attention(name, spec(device="meta"))  # a device where it is native
    assert _warnings(caplog) == []
    with caplog.at_level(logging.WARNING):
        reg.select_attention(name, spec())  # and on cpu, named, it warns: it was not already warned about
    assert len(_warnings(caplog)) == 1


def test_the_triton_backend_declares_its_interpreter_on_cpu() -> None:
    pytest.importorskip("corerun_attention_triton")
    from corerun_attention_triton.capabilities import CAPABILITIES

    assert CAPABILITIES.emulated_on == frozenset({"cpu"}) and "cuda" in CAPABILITIES.devices
