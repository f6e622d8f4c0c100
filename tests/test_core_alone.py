"""The core alone (no plugin distribution loaded): every default names a built-in, so ``LLM`` runs.

``CORERUN_PLUGINS=`` (empty) loads the built-ins only, as an installation of the ``corerun``
distribution by itself would.  Outputs are checked against Hugging Face's greedy continuation; a
missing transformers is reported with the pip command.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import corerun.plugin.registry as registry_module
from corerun import LLM, SamplingParams
from corerun.config import Config
from corerun.engine.input_processor import load_tokenizer as _load_tokenizer
from corerun.models.errors import ModelLoadError
from corerun.plugin.registry import Registry
from corerun.testing import hf_greedy
from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture
def core_only(monkeypatch: pytest.MonkeyPatch) -> Registry:
    monkeypatch.setenv(registry_module.ENV_ALLOW_LIST, "")
    reg = Registry.from_environment()
    assert set(reg.plugins) == {"corerun"}
    monkeypatch.setattr(registry_module, "_default", reg)
    return reg


def test_every_default_names_a_builtin(core_only: Registry) -> None:
    cfg = Config()
    for kind, name in (("sampler", cfg.sampler.name), ("kv_cache", cfg.kv_cache.manager.name)):
        assert core_only.get(kind, name).distribution == "corerun", (kind, name)
    for kind, name in (("attention", cfg.attention.name), ("graph", cfg.graph.runner.name)):
        assert name == "auto" or core_only.get(kind, name).distribution == "corerun", (kind, name)


def test_llm_with_every_default_runs_on_the_core_alone(core_only: Registry, tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "m", arch="llama")
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", kv_cache={"block_size": 4, "num_blocks": 32},
              scheduler={"max_model_len": 64})
    runner = llm.engine.runner
    assert (runner.attention_name, runner.kv_manager_name, runner.graph_name, runner.sampler_name) == (
        "torch", "paged", "eager", "full")
    prompts = [[5, 9, 13, 2], [7, 1]]
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == hf_greedy(model_dir, prompts, 6)
    # the parameters only the full sampler honours are accepted too
    rich = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=3,
                          max_tokens=4, ignore_eos=True)
    assert len(llm.generate([prompts[0]], rich, use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_a_tokenizer_without_transformers_names_the_pip_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(ModelLoadError) as err:
        _load_tokenizer(tmp_path)
    message = str(err.value)
    assert f"the tokenizer in {tmp_path} needs transformers" in message
    assert "pip install 'corerun[hf]', or set skip_tokenizer_init: true and pass token ids" in message
