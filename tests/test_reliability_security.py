"""Security basics: nothing a config file, a model folder or the working directory holds runs as code.

- YAML is read with ``safe_load``: a ``!!python/...`` tag is refused, and its payload never runs.
- Plugins load only from the ``corerun`` entry points of installed distributions (only those named in
  ``CORERUN_PLUGINS`` when it is set); a name in the config is a name, never an import path, and a
  module lying in the working directory is never imported.
- Weights never go through pickle by default; with ``allow_pickle_weights: true`` they go through
  ``torch.load(weights_only=True)``, which refuses a pickle that would call a function.

Each payload would create a marker file if it ran; every test checks the marker is absent.
"""

from __future__ import annotations

import pathlib
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import corerun.plugin.registry as registry_module
from corerun import LLM
from corerun.config import load_config, parse_set
from corerun.errors import ConfigError, PluginNotFoundError
from corerun.models.errors import ModelLoadError
from corerun.plugin.registry import Registry
from tests.helpers.tiny_models import make_tiny_model

COMMON: dict[str, Any] = dict(device="cpu", dtype="float32", attention="torch", kv_cache={"block_size": 4, "num_blocks": 16})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("reliability-security"), arch="llama")


class Payload:
    """Unpickling this calls ``Path.touch(marker)``: a stand-in for any code a pickle can run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return pathlib.Path.touch, (self.marker,)


def test_yaml_python_tags_refused(tmp_path: Path) -> None:
    marker = tmp_path / "yaml-ran"
    config = tmp_path / "evil.yaml"
    config.write_text(f"model: !!python/object/apply:builtins.open ['{marker}', 'w']\n")
    with pytest.raises(ConfigError, match="is not valid YAML: could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply"):
        load_config(config)
    with pytest.raises((ConfigError, yaml.YAMLError)):
        parse_set([f"model=!!python/object/apply:builtins.open ['{marker}', 'w']"])
    assert not marker.exists()
    # the same document through an unsafe loader would have run: the payload is real
    yaml.unsafe_load(config.read_text())["model"].close()
    assert marker.exists()


def _write_module(folder: Path, name: str, marker: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from corerun import hookimpl\n"
        "@hookimpl\n"
        "def corerun_attention_backends(register):\n"
        "    register('evil', 'corerun.attention.torch_backend:TorchAttentionBackend')\n"
        "class Backend:\n    pass\n"
    )


def test_config_names_are_never_import_paths(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "imported"
    _write_module(tmp_path / "mods", "corerun_reliability_probe", marker)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    for overrides in (
        {"attention": "corerun_reliability_probe:Backend"},
        {"sampler": "corerun_reliability_probe.Backend"},
        {"kv_cache": {"manager": "corerun_reliability_probe:Backend", "block_size": 4, "num_blocks": 16}},
    ):
        with pytest.raises(PluginNotFoundError, match="no .* named 'corerun_reliability_probe"):
            LLM(model=model_dir, **{**COMMON, **overrides})
    assert "corerun_reliability_probe" not in sys.modules
    assert not marker.exists()


def test_plugins_load_only_from_installed_entry_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin-looking module in the working directory (and on sys.path) is not a plugin."""
    marker = tmp_path / "imported"
    _write_module(tmp_path, "corerun_attention_evil", marker)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(registry_module.ENV_ALLOW_LIST, raising=False)
    reg = Registry.from_environment()
    installed = {ep.name for ep in registry_module.md.entry_points(group=registry_module.ENTRY_POINT_GROUP)}
    assert set(reg.plugins) == installed | {"corerun"}
    assert "evil" not in reg.names("attention")
    assert not marker.exists() and "corerun_attention_evil" not in sys.modules


def test_corerun_plugins_restricts_what_loads(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry_module.ENV_ALLOW_LIST, "sampler_basic")
    reg = Registry.from_environment()
    assert set(reg.plugins) == {"corerun", "sampler_basic"}  # built-ins always, then only the named ones
    assert sorted(reg.names("sampler")) == ["basic", "full"] and reg.names("attention") == ["torch"]  # full: built in
    monkeypatch.setattr(registry_module, "_default", reg)
    with pytest.raises(PluginNotFoundError) as err:
        LLM(model=model_dir, **{**COMMON, "attention": "triton"})
    assert "pip install corerun-attention-triton (and allow it in CORERUN_PLUGINS)" in str(err.value)
    llm = LLM(model=model_dir, **{**COMMON, "sampler": "basic"})
    assert len(llm.generate([5, 6, 7], {"temperature": 0, "max_tokens": 3})[0].outputs[0].token_ids) == 3
    monkeypatch.setenv(registry_module.ENV_ALLOW_LIST, "")
    assert set(Registry.from_environment().plugins) == {"corerun"}


def test_pickle_weights_never_run_code(tmp_path: Path, model_dir: Path) -> None:
    marker = tmp_path / "unpickled"
    folder = tmp_path / "evil-model"
    folder.mkdir()
    shutil.copy(model_dir / "config.json", folder / "config.json")
    torch.save({"model.embed_tokens.weight": Payload(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="has only pickle weights"):
        LLM(model=folder, **COMMON)
    assert not marker.exists()
    with pytest.raises(Exception, match="Weights only load failed") as err:  # allowed: still weights_only
        LLM(model=folder, allow_pickle_weights=True, **COMMON)
    assert isinstance(err.value, (ModelLoadError, __import__("pickle").UnpicklingError))
    assert not marker.exists()
    # safetensors next to a pickle: the pickle is never read, even when allowed
    shutil.copy(model_dir / "model.safetensors", folder / "model.safetensors")
    llm = LLM(model=folder, allow_pickle_weights=True, **COMMON)
    assert len(llm.generate([5, 6], {"temperature": 0, "max_tokens": 2})[0].outputs[0].token_ids) == 2
    assert not marker.exists()
    # the payload is real: an unrestricted unpickle runs it
    torch.load(folder / "pytorch_model.bin", weights_only=False)
    assert marker.exists()
