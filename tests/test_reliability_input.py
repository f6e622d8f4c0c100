"""Bad input is refused up front, with an error naming what was wrong and what would be right, and the
engine keeps serving: after every refusal a valid request is generated and checked token for token
against Hugging Face transformers' greedy continuation (the independent reference).

Covers invalid SamplingParams (vLLM's rules, NaN and infinities), bad prompts (empty, too long, ids
outside the vocabulary or of the wrong type), a list with one bad prompt (its index named, nothing
queued), requests that could never be scheduled (bigger than the whole KV cache, or than one step's
budget without chunked prefill: refused, never a hang), and bad configurations and model folders.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from corerun import LLM, SamplingParams
from corerun.config import load_config
from corerun.errors import ConfigError, PluginNotFoundError, RequestError
from corerun.models.errors import ModelLoadError
from corerun.testing import assert_idle, make_llm
from tests.helpers.tiny_models import make_tiny_model
from tests.helpers.engine_testing import hf_greedy, no_hang  # noqa: F401 (no_hang: a fixture)

VOCAB = 256
BS = 4
NUM_BLOCKS = 40
MAX_MODEL_LEN = 128
VALID = [5, 17, 42, 99, 7, 61]
VALID_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("reliability-input"), arch="llama")


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[int]:
    return hf_greedy(model_dir, [VALID], VALID_TOKENS)[0]


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return make_llm(model_dir, kv_cache={"block_size": BS, "num_blocks": NUM_BLOCKS}, scheduler={"max_model_len": MAX_MODEL_LEN})


def assert_serves(llm: LLM, expected: list[int]) -> None:
    """The engine is idle, then answers a valid request exactly as transformers does."""
    assert_idle(llm)
    out = llm.generate([VALID], SamplingParams(temperature=0, max_tokens=VALID_TOKENS, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected
    assert out[0].outputs[0].finish_reason == "length"
    assert_idle(llm)


# ------------------------------------------------------------------ SamplingParams

nan, inf = math.nan, math.inf
BAD_PARAMS = [
    # (fields, what the error must name, what it says would be right)
    ({"temperature": -0.5}, "temperature", ">= 0"),
    ({"temperature": nan}, "temperature", "finite"),
    ({"temperature": inf}, "temperature", "finite"),
    ({"temperature": True}, "temperature", "must be a number"),
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_p": nan}, "top_p", "(0, 1]"),
    ({"top_k": -2}, "top_k", "-1 or 0"),
    ({"top_k": 2.5}, "top_k", "valid integer"),
    ({"min_p": -0.1}, "min_p", "[0, 1]"),
    ({"min_p": nan}, "min_p", "[0, 1]"),
    ({"min_p": inf}, "min_p", "[0, 1]"),
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"presence_penalty": nan}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -inf}, "frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
    ({"repetition_penalty": inf}, "repetition_penalty", "finite"),
    ({"repetition_penalty": nan}, "repetition_penalty", "finite"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"max_tokens": inf}, "max_tokens", "finite"),
    ({"min_tokens": -1}, "min_tokens", ">= 0"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens", "<= max_tokens"),
    ({"logprobs": -1}, "logprobs", "between 0 and 20"),
    ({"logprobs": 21}, "logprobs", "between 0 and 20"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "between 0 and 20"),
    ({"seed": 2**64}, "seed", "64-bit"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", ">= 0"),
    ({"logit_bias": {3: nan}}, "logit_bias", "finite, or -inf"),
    ({"logit_bias": {3: inf}}, "logit_bias", "finite, or -inf"),
    ({"logit_bias": {-3: 1.0}}, "logit_bias", ">= 0"),
]


@pytest.mark.parametrize(("fields", "field", "right"), BAD_PARAMS, ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_invalid_sampling_params_refused(llm: LLM, expected: list[int], fields: dict, field: str, right: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**fields)
    assert field in str(err.value) and right in str(err.value)
    # the same values handed to the engine as a dict: refused as a request error, nothing queued
    with pytest.raises(RequestError) as err:
        llm.generate([VALID, VALID], [SamplingParams(temperature=0), fields])
    assert "prompt 1" in str(err.value) and field in str(err.value) and right in str(err.value)
    assert_serves(llm, expected)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"logit_bias": {VOCAB: 1.0}}, f"logit_bias has token ids outside the vocabulary [0, {VOCAB}): [{VOCAB}]"),
        ({"stop_token_ids": [3, VOCAB + 7]}, f"stop_token_ids has token ids outside the vocabulary [0, {VOCAB}): [{VOCAB + 7}]"),
        ({"logit_bias": {t: -inf for t in range(VOCAB)}}, f"bans all {VOCAB} tokens"),
        ({"logprobs": 20, "max_tokens": 2}, None),  # the edge of the allowed range is served
    ],
    ids=["logit-bias-id", "stop-id", "all-banned", "logprobs-20"],
)
def test_token_ids_in_params_checked_against_the_vocabulary(llm: LLM, expected: list[int], fields: dict, message: str | None) -> None:
    params = SamplingParams(**fields)  # valid on their own: only the model knows its vocabulary
    if message is None:
        out = llm.generate(VALID, params)[0].outputs[0]
        assert len(out.token_ids) == 2 and len(out.logprobs) == 2 and all(len(d) >= 20 for d in out.logprobs)
    else:
        with pytest.raises(RequestError, match=r"^prompt 0: ") as err:
            llm.generate(VALID, params)
        assert message in str(err.value)
    assert_serves(llm, expected)


# ------------------------------------------------------------------------- prompts

BAD_PROMPTS = [
    ([[]], ["prompt is empty", "at least one token"]),
    ("", ["prompt is empty"]),
    ("hello", ["no tokenizer", "pass token ids"]),
    (list(range(3, 3 + MAX_MODEL_LEN)), [f"prompt has {MAX_MODEL_LEN} tokens", f"max_model_len is {MAX_MODEL_LEN}", "shorter"]),
    ([5, VOCAB], [f"prompt token 1 is {VOCAB}", f"[0, {VOCAB})"]),
    ([5, 6, -1], ["prompt token 2 is -1", f"[0, {VOCAB})"]),
    ([5, 2.0], ["prompt token 1 is 2.0 (float)", f"integers in [0, {VOCAB})"]),
    ([[5, "7"]], ["prompt token 1 is '7' (str)", f"integers in [0, {VOCAB})"]),
    ([5, True], ["prompt token 1 is True (bool)", "integers"]),
    ([None, 5], ["prompt token 0 is None (NoneType)", "integers"]),
    (7, ["got int", "a string or a list of token ids"]),
    (b"\x05\x06", ["bytes", "a string or a list of token ids"]),
]


@pytest.mark.parametrize(("prompt", "fragments"), BAD_PROMPTS, ids=lambda v: repr(v)[:24] if not isinstance(v, list) or len(v) < 9 else None)
def test_bad_prompt_refused_and_engine_serves_on(llm: LLM, expected: list[int], prompt: Any, fragments: list[str]) -> None:
    with pytest.raises(RequestError) as err:
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3))
    for fragment in fragments:
        assert fragment in str(err.value)
    assert_serves(llm, expected)


def test_longest_prompt_allowed_is_served(llm: LLM) -> None:
    """max_model_len - 1 prompt tokens leave room for exactly one generated token."""
    prompt = [3 + i % 250 for i in range(MAX_MODEL_LEN - 1)]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=50))[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    assert_idle(llm)


def test_one_bad_prompt_in_a_list_names_its_index_and_queues_nothing(llm: LLM, expected: list[int]) -> None:
    prompts = [[1, 2, 3], [4, 5], [6, 7, VOCAB + 1], [8]]
    with pytest.raises(RequestError, match=rf"^prompt 2: prompt token 2 is {VOCAB + 1}"):
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3))
    assert_idle(llm)
    params = [SamplingParams(), SamplingParams(), SamplingParams(), {"top_p": 0.0}]
    with pytest.raises(RequestError, match=r"^prompt 3: invalid sampling_params: top_p: top_p must be in \(0, 1\], got 0.0$"):
        llm.generate([[1, 2, 3], [4, 5], [6, 7], [8]], params)
    assert_idle(llm)
    with pytest.raises(RequestError, match="3 entries but there are 4 prompts"):
        llm.generate([[1, 2, 3], [4, 5], [6, 7], [8]], params[:3])
    assert_idle(llm)
    with pytest.raises(RequestError, match="^prompt 1: sampling_params must be a SamplingParams"):
        llm.generate([[1], [2]], [SamplingParams(), "greedy"])
    assert_serves(llm, expected)


def test_engine_add_request_refuses_without_queueing(llm: LLM, expected: list[int]) -> None:
    engine = llm.engine
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request([1, VOCAB], SamplingParams())
    with pytest.raises(RequestError, match="^invalid sampling_params: temperature: .*finite number >= 0.*got nan$"):
        engine.add_request([1, 2], {"temperature": nan})
    with pytest.raises(RequestError, match="^invalid sampling_params: temprature: unknown field; SamplingParams has .*temperature"):
        engine.add_request([1, 2], {"temprature": 0.5})
    rid = engine.add_request([1, 2], SamplingParams(max_tokens=1), request_id="taken")
    with pytest.raises(RequestError, match="'taken' is already in use"):
        engine.add_request([3], SamplingParams(), request_id="taken")
    engine.abort(rid)
    engine.release(rid)
    assert_serves(llm, expected)


# ------------------------------------------------------- requests that could never run

def test_request_bigger_than_the_whole_cache_refused_up_front(model_dir: Path, expected: list[int]) -> None:
    """8 blocks of 4 hold 32 tokens of K/V; a request holds prompt + max_tokens - 1 of them at most."""
    small = make_llm(model_dir, kv_cache={"block_size": BS, "num_blocks": 8}, scheduler={"max_model_len": MAX_MODEL_LEN})
    prompt = list(range(10, 20))
    with pytest.raises(RequestError) as err:
        small.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for fragment in ("needs up to 9 KV-cache blocks", "the whole cache has 8", "lower max_tokens to at most 23"):
        assert fragment in str(err.value)
    assert_idle(small)
    # exactly the whole cache is served, next to others that must be preempted for it
    outs = small.generate([prompt, [3, 4, 5, 6, 7], VALID], [
        SamplingParams(temperature=0, max_tokens=23, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=VALID_TOKENS, ignore_eos=True),
    ])
    assert [len(o.outputs[0].token_ids) for o in outs] == [23, 12, VALID_TOKENS]
    assert outs[2].outputs[0].token_ids == expected
    assert small.engine.scheduler.num_preemptions > 0
    assert_serves(small, expected)


def test_request_over_the_step_budget_without_chunked_prefill_refused(model_dir: Path, expected: list[int]) -> None:
    """Without chunked prefill a (re)computed sequence must fit one step: a longer one would wait forever."""
    llm = make_llm(model_dir, kv_cache={"block_size": BS, "num_blocks": NUM_BLOCKS},
                   scheduler={"max_model_len": MAX_MODEL_LEN, "chunked_prefill": False, "max_num_batched_tokens": 16})
    for prompt, max_tokens in ((list(range(3, 23)), 1), (list(range(3, 13)), 8)):
        with pytest.raises(RequestError) as err:
            llm.generate(prompt, SamplingParams(max_tokens=max_tokens))
        assert "max_num_batched_tokens is 16 and chunked_prefill is off" in str(err.value)
        assert_idle(llm)
    out = llm.generate(list(range(3, 13)), SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 7
    assert_serves(llm, expected)


# --------------------------------------------------------------------- configuration

def test_malformed_yaml_unknown_keys_and_wrong_types(tmp_path: Path, llm: LLM, expected: list[int]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kv_cache: {block_size: 8\nattention: torch\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml is not valid YAML") as err:
        load_config(bad)
    assert "line" in str(err.value)
    listing = tmp_path / "list.yaml"
    listing.write_text("- model\n- dtype\n")
    with pytest.raises(ConfigError, match="must hold a mapping of keys, got list"):
        load_config(listing)
    typo = tmp_path / "typo.yaml"
    typo.write_text("kv_cache:\n  blok_size: 8\nschedulr: {}\n")
    with pytest.raises(ConfigError) as err:
        load_config(typo)
    for fragment in ("kv_cache.blok_size: unknown key", "did you mean 'block_size'?", "schedulr: unknown key", "did you mean 'scheduler'?"):
        assert fragment in str(err.value)
    wrong = [
        ({"kv_cache": {"num_blocks": "many"}}, ["kv_cache.num_blocks", "'auto'", "'many'"]),
        ({"kv_cache": {"block_size": 12}}, ["kv_cache.block_size", "power of two", "12"]),
        ({"scheduler": {"max_num_seqs": 0}}, ["scheduler.max_num_seqs", "greater than or equal to 1"]),
        ({"dtype": "float8"}, ["dtype", "'float32'", "'float8'"]),
        ({"attention": 3}, ["attention", "implementation name", "3"]),
    ]
    for overrides, fragments in wrong:
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides=overrides)
        for fragment in fragments:
            assert fragment in str(err.value), (overrides, str(err.value))
    assert_serves(llm, expected)


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        ({"attention": "trition"}, ["no attention backend named 'trition'", "Installed:", "torch (corerun)", "Did you mean 'triton'?"]),
        ({"sampler": "fulll"}, ["no sampler named 'fulll'", "full (corerun)", "Did you mean 'full'?"]),
        ({"kv_cache": {"manager": "pagd"}}, ["no KV-cache manager named 'pagd'", "paged (corerun)", "Did you mean 'paged'?"]),
        ({"graph": {"runner": "eagr"}}, ["no graph runner named 'eagr'", "eager (corerun)", "Did you mean 'eager'?"]),
    ],
    ids=["attention", "sampler", "kv_cache", "graph"],
)
def test_unknown_backend_names(model_dir: Path, llm: LLM, expected: list[int], overrides: dict, fragments: list[str]) -> None:
    kv_cache = {"block_size": BS, "num_blocks": 8, **overrides.get("kv_cache", {})}
    with pytest.raises(PluginNotFoundError) as err:
        make_llm(model_dir, **{**overrides, "kv_cache": kv_cache})
    for fragment in fragments:
        assert fragment in str(err.value)
    assert_serves(llm, expected)


# --------------------------------------------------------------------- model folders

def _folder_with(tmp_path: Path, name: str, source: Path, files: list[str]) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    for f in files:
        shutil.copy(source / f, folder / f)
    return folder


def test_broken_model_folders(tmp_path: Path, model_dir: Path, llm: LLM, expected: list[int]) -> None:
    cases: list[tuple[Path, type[Exception], list[str]]] = []
    cases.append((tmp_path / "absent", ModelLoadError, ["does not exist"]))
    empty = tmp_path / "empty"
    empty.mkdir()
    cases.append((empty, ModelLoadError, ["has no config.json", "config.json and its *.safetensors"]))
    no_weights = _folder_with(tmp_path, "no-weights", model_dir, ["config.json"])
    cases.append((no_weights, ModelLoadError, ["has no weights", "expected model.safetensors", "found: config.json"]))
    no_config = _folder_with(tmp_path, "no-config", model_dir, ["model.safetensors"])
    cases.append((no_config, ModelLoadError, ["has no config.json"]))
    # an architecture corerun does not implement
    other = _folder_with(tmp_path, "other-arch", model_dir, ["config.json", "model.safetensors"])
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}))
    cases.append((other, ValueError, ["GPTNeoXForCausalLM", "not supported", "LlamaForCausalLM"]))
    # config.json of another architecture over these weights: every mismatch listed, with both shapes
    qwen3 = make_tiny_model(tmp_path / "qwen3-src", arch="qwen3")
    mixed = _folder_with(tmp_path, "mismatched", model_dir, ["model.safetensors"])
    shutil.copy(qwen3 / "config.json", mixed / "config.json")
    cases.append((mixed, ModelLoadError, ["into Qwen3ForCausalLM", "shape mismatches", "corerun expects", "the checkpoint has", "missing weights"]))
    for folder, error, fragments in cases:
        with pytest.raises(error) as err:
            make_llm(folder, kv_cache={"block_size": BS, "num_blocks": 8})
        for fragment in fragments:
            assert fragment in str(err.value), (folder.name, str(err.value))
    assert_serves(llm, expected)


def test_pickle_weights_refused_unless_allowed(tmp_path: Path, model_dir: Path, expected: list[int]) -> None:
    from safetensors.torch import load_file

    folder = _folder_with(tmp_path, "pickled", model_dir, ["config.json"])
    torch.save(load_file(str(model_dir / "model.safetensors")), folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError) as err:
        make_llm(folder, kv_cache={"block_size": BS, "num_blocks": 8})
    for fragment in ("only pickle weights (pytorch_model.bin)", "unpickling a file can run code", "allow_pickle_weights: true"):
        assert fragment in str(err.value)
    allowed = make_llm(folder, allow_pickle_weights=True, kv_cache={"block_size": BS, "num_blocks": NUM_BLOCKS})
    assert_serves(allowed, expected)
