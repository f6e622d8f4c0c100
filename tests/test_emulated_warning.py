"""An attention backend named explicitly where it runs in an interpreter or emulator (its capabilities'
``emulated_on``; Triton on CPU) is used as asked, with one warning per process that it is slow."""

from __future__ import annotations

import logging

import pytest

import corerun.registry as registry_module
from corerun.capabilities import AttentionCapabilities
from tests.test_registry import Provides, Recorder, builtins_only, spec

SLOW = AttentionCapabilities(devices=frozenset({"cpu", "cuda", "meta"}), emulated_on=frozenset({"cpu"}))


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module, "_warned_emulated", set())


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_named_on_an_emulated_device_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    reg = builtins_only((Provides(attention=[("interp", Recorder(), {"capabilities": SLOW, "priority": 5})]), "interp", "corerun-interp"))
    with caplog.at_level(logging.WARNING):
        assert reg.select_attention("interp", spec()).name == "interp"
        assert reg.select_attention("interp", spec()).name == "interp"
    (warning,) = _warnings(caplog)
    assert warning.startswith("attention: 'interp' runs in an interpreter or emulator on cpu, not as native code")
    assert "attention: auto" in warning


def test_auto_native_devices_and_other_backends_do_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    reg = builtins_only((Provides(attention=[("interp", Recorder(), {"capabilities": SLOW})]), "interp", "corerun-interp"))
    with caplog.at_level(logging.WARNING):
        reg.select_attention("torch", spec())
        reg.select_attention("auto", spec())
        reg.select_attention("interp", spec(device="meta"))  # a device where it is native
    assert _warnings(caplog) == []


def test_the_triton_backend_declares_its_interpreter_on_cpu() -> None:
    pytest.importorskip("corerun_attention_triton")
    from corerun_attention_triton.capabilities import CAPABILITIES

    assert CAPABILITIES.emulated_on == frozenset({"cpu"}) and "cuda" in CAPABILITIES.devices
