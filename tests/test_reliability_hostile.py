"""Hostile input, round two: every case a named corerun error or a correct result, never a raw exception.

- token ids checked against the model's vocabulary at admission, however they were produced (a
  tokenizer larger than the model): the bad request is refused alone, the others in flight finish;
- YAML limits: an alias bomb (in the config and in plugin options), deep nesting, a huge file, bytes
  that are not UTF-8: a short ConfigError naming the file;
- the weight index may not name a pickle, nor a file outside the model folder (``../``, absolute,
  symlink); truncated safetensors and corrupt tokenizer files are named;
- values that overflow float32 in the sampler (logit_bias, repetition_penalty, temperature) refused;
- logprobs above the vocabulary refused at admission;
- config.json of the wrong shape or types, sizes the weights cannot hold; config knobs that overflow,
  booleans as numbers, an empty model name; a lone surrogate in a text prompt; the CLI's messages.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from corerun import LLM, SamplingParams
from corerun.config import load_config, parse_set
from corerun.errors import ConfigError, RequestError
from corerun.models.errors import ModelLoadError
from corerun.testing import assert_idle, make_llm
from tests.helpers.engine_testing import no_hang  # noqa: F401 (no_hang: a fixture)
from tests.helpers.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("reliability-hostile"), arch="llama")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return make_llm(model_dir)


def copy_model(model_dir: Path, dest: Path) -> Path:
    shutil.copytree(model_dir, dest)
    return dest


def word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A whitespace word-level tokenizer whose ids run up to ``vocab_size - 1`` ("w<i>" -> i)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(folder))


# ------------------------------------------------------------------ 4. vocabulary at admission

def test_tokenizer_ids_beyond_the_model_vocab_refused_alone(model_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(model_dir, tmp_path / "big-tokenizer")
    word_tokenizer(folder, vocab_size=300)  # the model has 256 ids
    llm = make_llm(folder)
    (ok,) = llm.generate([[5, 6, 7]], GREEDY)
    running = llm.stream("w5 w6 w7", GREEDY)  # a good text prompt in flight
    first = next(running)
    with pytest.raises(RequestError, match=r"token 299 \(position 1\), outside the model's vocabulary \[0, 256\)"):
        llm.generate(["w3 w299"], GREEDY)
    rest = list(running)
    assert rest[-1].outputs[0].finish_reason == "length"
    assert rest[-1].outputs[0].token_ids == ok.outputs[0].token_ids  # the same prompt, as ids
    assert first.prompt_token_ids == [5, 6, 7]
    assert_idle(llm)


# ------------------------------------------------------------------ 5. YAML limits

def alias_bomb(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines)


@pytest.mark.parametrize("where", ["top", "plugin-options"])
def test_yaml_alias_bomb_is_a_short_error(tmp_path: Path, where: str) -> None:
    bomb = alias_bomb()
    text = bomb if where == "top" else "attention:\n  name: torch\n  options:\n" + "\n".join("    " + l for l in bomb.splitlines())
    path = tmp_path / "bomb.yaml"
    path.write_text(text + "\n")
    assert len(text) < 600  # 9**9 = 387 million strings once expanded
    with pytest.raises(ConfigError, match="more than 100000 values once aliases") as err:
        load_config(path)
    assert len(str(err.value)) < 400
    with pytest.raises(ConfigError, match="more than 100000 values once aliases"):
        parse_set(["attention.options.x=" + "{" + bomb.replace("\n", ", ") + "}"])


def test_yaml_depth_size_and_encoding_limits(tmp_path: Path) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text("attention: " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(ConfigError, match="nested more than 32 levels"):
        load_config(deep)
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (2 << 20) + "\nseed: 1\n")
    with pytest.raises(ConfigError, match=r"big.yaml is \d+ bytes; a configuration is at most 1048576"):
        load_config(big)
    latin = tmp_path / "latin1.yaml"
    latin.write_bytes("model: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.yaml is not UTF-8 text \(byte 10 is 0xe9\)"):
        load_config(latin)


# ------------------------------------------------------------------ 6. the weight index gate

def test_index_cannot_name_a_pickle(model_dir: Path, tmp_path: Path) -> None:
    from tests.test_reliability_security import Payload

    marker = tmp_path / "unpickled"
    folder = tmp_path / "evil-index"
    folder.mkdir()
    shutil.copy(model_dir / "config.json", folder)
    torch.save({"model.embed_tokens.weight": Payload(marker)}, folder / "evil.bin")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "evil.bin"}}))
    for allow in (False, True):
        with pytest.raises(ModelLoadError, match=r"names 'evil.bin', which is not a .safetensors file"):
            make_llm(folder, allow_pickle_weights=allow)
    assert not marker.exists()


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_index_cannot_reach_outside_the_folder(model_dir: Path, tmp_path: Path, how: str) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(model_dir / "config.json", folder)
    outside = tmp_path / "elsewhere" / "model.safetensors"
    outside.parent.mkdir()
    shutil.copy(model_dir / "model.safetensors", outside)
    if how == "dotdot":
        name = "../elsewhere/model.safetensors"
    elif how == "absolute":
        name = str(outside)
    else:
        name = "model-00001.safetensors"
        (folder / name).symlink_to(outside)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": name}}))
    with pytest.raises(ModelLoadError, match=r"resolves to .*elsewhere.*, outside the model folder"):
        make_llm(folder)
    if how == "symlink":  # a lone model.safetensors linked out of the folder: the same
        (folder / "model.safetensors.index.json").unlink()
        (folder / "model.safetensors").symlink_to(outside)
        with pytest.raises(ModelLoadError, match="outside the model folder"):
            make_llm(folder)


def test_hub_cache_links_into_its_blobs_still_load(model_dir: Path, tmp_path: Path) -> None:
    repo = tmp_path / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, repo / "blobs" / f"sha-{name}")
        (snap / name).symlink_to(Path("../../blobs") / f"sha-{name}")
    out = make_llm(snap).generate([[5, 6]], GREEDY)[0]
    assert len(out.outputs[0].token_ids) == 6


# ------------------------------------------------------------------ 7. float32 overflow

@pytest.mark.parametrize(("fields", "message"), [
    ({"logit_bias": {3: 1e300}}, r"logit_bias values must be within \+-1e\+06 .* got 1e\+300 for token 3"),
    ({"logit_bias": {3: -1e300}}, r"logit_bias values must be within \+-1e\+06 .* got -1e\+300 for token 3"),
    ({"repetition_penalty": 1e-300}, r"repetition_penalty must be in \[1e-06, 1e\+06\]"),
    ({"repetition_penalty": 1e300}, r"repetition_penalty must be in \[1e-06, 1e\+06\]"),
    ({"temperature": 1e300}, r"temperature must be <= 1e\+06"),
])
def test_values_that_overflow_float32_are_refused(llm: LLM, fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)
    with pytest.raises(RequestError, match=message):
        llm.generate([[5, 6]], fields)
    # the bounds themselves work: every token banned but one by -1e6 still leaves that one
    keep = 77
    out = llm.generate([[5, 6]], {"temperature": 0, "max_tokens": 3, "logit_bias": {t: -1e6 for t in range(256) if t != keep}})
    assert out[0].outputs[0].token_ids == [keep] * 3
    assert_idle(llm)


# ------------------------------------------------------------------ 8. logprobs above the vocabulary

def test_logprobs_above_the_vocabulary_refused(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, arch="llama", vocab_size=16)
    llm = make_llm(folder)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(RequestError, match=f"{field}=17 is above the model's vocabulary size 16"):
            llm.generate([[1, 2, 3]], {"max_tokens": 2, field: 17})
    out = llm.generate([[1, 2, 3]], {"temperature": 0, "max_tokens": 2, "logprobs": 16, "prompt_logprobs": 16})[0]
    assert all(len(d) == 16 for d in out.outputs[0].logprobs)  # every token, the chosen one among them
    assert_idle(llm)


# ------------------------------------------------------------------ 9. named errors, not raw exceptions

@pytest.mark.parametrize(("edit", "message"), [
    (lambda c: [c], r"config.json must hold a JSON object of settings, got a list"),
    (lambda c: {**c, "num_attention_heads": 0}, r"config.json: num_attention_heads must be a whole number in \[1, 2147483647\], got 0"),
    (lambda c: {**c, "num_key_value_heads": "2"}, r"config.json: num_key_value_heads must be a whole number .* got '2'"),
    (lambda c: {**c, "eos_token_id": "</s>"}, r"config.json: eos_token_id must be a token id .* got '</s>'"),
    (lambda c: {**c, "rms_norm_eps": "tiny"}, r"config.json: a value has the wrong type or range: ValueError"),
    (lambda c: {**c, "num_hidden_layers": 10**6}, r"describes a model of at least [\d,]+ parameters \(1,000,000 layers.* the weight files hold only"),
])
def test_bad_config_json_named(model_dir: Path, tmp_path: Path, edit: Any, message: str) -> None:
    folder = copy_model(model_dir, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(cfg)))
    with pytest.raises(ModelLoadError, match=message):
        make_llm(folder)


def test_truncated_weights_and_corrupt_tokenizer_named(model_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(model_dir, tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model.safetensors: cannot read it as safetensors .* truncated or corrupt"):
        make_llm(folder)
    folder = copy_model(model_dir, tmp_path / "t")
    word_tokenizer(folder, 256)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "nonsense"')
    with pytest.raises(ModelLoadError, match=r"cannot load the tokenizer in .*t \(tokenizer.json, tokenizer_config.json\)"):
        make_llm(folder)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"kv_cache": {"cpu_memory_gb": float("inf")}}, "kv_cache.cpu_memory_gb: Input should be a finite number"),
    ({"seed": 2**70}, "seed: Input should be less than or equal to 18446744073709551615"),
    ({"kv_cache": {"num_blocks": 10**30}}, r"num_blocks must be at most 2147483647 \(block ids are int32\) or .auto."),
    ({"scheduler": {"max_num_batched_tokens": 10**30}}, r"scheduler.max_num_batched_tokens is 10{30}, beyond the largest"),
    ({"kv_cache": {"block_size": True}}, "kv_cache.block_size: expected a number, got the boolean True"),
    ({"model": ""}, "model: model is empty: give a model folder, or leave it out"),
])
def test_config_values_that_overflow_or_mislead_are_named(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides=overrides)


def test_lone_surrogate_prompt_is_a_request_error(model_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(model_dir, tmp_path / "m")
    word_tokenizer(folder, 256)
    llm = make_llm(folder)
    with pytest.raises(RequestError, match=r"prompt 0: prompt is not valid Unicode text: character 3 is a lone surrogate"):
        llm.generate(["w5 \ud800"], GREEDY)
    assert llm.generate("w5 w6", GREEDY)[0].prompt_token_ids == [5, 6]
    assert_idle(llm)


# ------------------------------------------------------------------ 10. the smaller ones

def test_prompt_dicts_and_sampling_params_misuse(model_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(model_dir, tmp_path / "m")
    word_tokenizer(folder, 256)
    llm = make_llm(folder)
    a, b = llm.generate([{"prompt": "w5 w6"}, {"prompt_token_ids": [5, 6]}], GREEDY)  # vLLM's prompt dicts
    assert a.prompt_token_ids == b.prompt_token_ids == [5, 6] and a.outputs[0].token_ids == b.outputs[0].token_ids
    with pytest.raises(RequestError, match=r"takes 'prompt' \(text\) or 'prompt_token_ids' .* got keys \['text'\]"):
        llm.generate([{"text": "w5"}], GREEDY)
    with pytest.raises(RequestError, match="sampling_params must be a SamplingParams, a dict of its fields, or a list .* got str 'greedy'"):
        llm.generate(["w5"], "greedy")
    assert_idle(llm)


def run_cli(args: list[str], stdin: str | bytes | None = None) -> Any:
    from corerun.cli import cli

    return CliRunner().invoke(cli, args, input=stdin)


def test_cli_empty_stdin_and_surrogates(model_dir: Path, tmp_path: Path) -> None:
    folder = copy_model(model_dir, tmp_path / "m")
    word_tokenizer(folder, 256)
    base = ["generate", "--model", str(folder), "--device", "cpu", "--attention", "torch", "--max-tokens", "2"]
    r = run_cli(base, stdin="\n\n")
    assert r.exit_code == 2 and "stdin held no prompt" in r.output
    r = run_cli(base + ["w5 \udcff"])
    assert r.exit_code == 1 and "lone surrogate" in r.output and "Traceback" not in r.output
    r = run_cli(base + ["--set", "kv_cache.block_size=true", "w5"])
    assert r.exit_code == 1 and "kv_cache.block_size: expected a number" in r.output


def test_kv_cache_larger_than_memory_refused_before_allocating(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"kv_cache.num_blocks=2147483647 needs [\d.]+ GiB of KV cache .* lower num_blocks"):
        make_llm(model_dir, kv_cache={"block_size": 16, "num_blocks": 2**31 - 1})
