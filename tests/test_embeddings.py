"""LLM.embed: pooled final hidden states equal transformers' (float64, the pooling computed here), with
the model's own pooling read from sentence-transformers files; embedding requests batched with
generation leave its greedy outputs as they are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from corerun.errors import RequestError
from corerun.engine.pooling import embedding_params, read_model_pooling
from corerun.models.errors import ModelLoadError
from corerun.sampling_params import SamplingParams
from corerun.testing import assert_idle, make_llm
from corerun.testing.tiny_models import make_tiny_model

PROMPTS = [[5, 9, 2, 77, 31, 8, 14, 3, 99, 41, 7, 12, 60, 21, 2, 5, 18], [3, 4], [250, 1, 17, 17, 17, 42, 11]]


def write_sentence_transformers(folder: Path, mode: str | None, normalize: bool) -> None:
    """sentence-transformers' own files for ``folder``: a Pooling module with ``mode`` (None: no
    Pooling module), and Normalize when ``normalize``."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if mode is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (folder / "1_Pooling").mkdir()
        flags = {f"pooling_mode_{m}": m == mode for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags}))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))


def reference(folder: Path, ids: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    """transformers' base model in float64: its last hidden states pooled as stated."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(folder), torch_dtype=torch.float64, attn_implementation="eager").eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    vec = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    return vec / vec.norm() if normalize else vec


# (sentence-transformers pooling mode or None for no files, Normalize module, the pooling it means)
CASES = {
    "default": (None, None, "last", True),  # no modules.json: last token, normalised
    "mean": ("mean_tokens", True, "mean", True),
    "last-raw": ("lasttoken", False, "last", False),
    "cls": ("cls_token", True, "cls", True),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("case", list(CASES))
def test_embed_equals_transformers(tmp_path: Path, arch: str, case: str) -> None:
    mode, norm, pooling, normalize = CASES[case]
    folder = make_tiny_model(tmp_path, arch)
    if mode is not None:
        write_sentence_transformers(folder, mode, bool(norm))
    # a step budget of 8 tokens: the 17-token prompt is pooled over three chunks; the second round finds
    # the prompts' blocks in the prefix cache (last-token pooling reuses them, mean and cls may not)
    with make_llm(folder, scheduler={"max_num_batched_tokens": 8}) as llm:
        for _ in range(2):
            outs = llm.embed(PROMPTS)
            assert [o.prompt_token_ids for o in outs] == PROMPTS
            for ids, out in zip(PROMPTS, outs):
                got = torch.tensor(out.outputs.embedding, dtype=torch.float64)
                want = reference(folder, ids, pooling, normalize)
                assert got.shape == want.shape
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
                assert out.finished and out.finish_reason == "stop"
        assert_idle(llm)


def _run_direct(engine, requests: list[tuple[list[int], SamplingParams]], steps: list | None = None) -> list:
    """Every request added before the first step, then stepped to the end: they share steps.  ``steps``
    gets the request ids each step touched."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    done = {}
    while engine.has_unfinished_requests():
        touched = engine.step()
        if steps is not None:
            steps.append({seq.request_id for seq in touched})
        for seq in touched:
            if seq.is_finished:
                done[seq.request_id] = engine.output(seq)
                engine.release(seq.request_id)
    return [done[i] for i in ids]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_generation_beside_embeddings_keeps_its_outputs(tmp_path: Path, async_scheduling: bool) -> None:
    folder = make_tiny_model(tmp_path, "llama")
    write_sentence_transformers(folder, "mean_tokens", True)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    gen_prompts = [[7, 8, 9, 10, 11], [40, 41, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    with make_llm(folder, scheduler={"max_num_batched_tokens": 16, "async_scheduling": async_scheduling}) as llm:
        alone = [o.outputs[0].token_ids for o in _run_direct(llm.engine, [(p, greedy) for p in gen_prompts])]
        emb = embedding_params(llm.model_pooling)
        steps: list[set[str]] = []
        mixed = _run_direct(llm.engine, [(gen_prompts[0], greedy), *[(p, emb) for p in PROMPTS], (gen_prompts[1], greedy)],
                            steps)
        assert [mixed[0].outputs[0].token_ids, mixed[-1].outputs[0].token_ids] == alone
        generating, embedding = {mixed[0].request_id, mixed[-1].request_id}, {o.request_id for o in mixed[1:-1]}
        assert any(ids & generating and ids & embedding for ids in steps)  # an embedding finished in a decode step
        for ids, out in zip(PROMPTS, mixed[1:-1]):
            want = reference(folder, ids, "mean", True)
            torch.testing.assert_close(torch.tensor(out.outputs.embedding, dtype=torch.float64), want, rtol=1e-4, atol=1e-5)
        assert_idle(llm)


def test_dimensions_refused_without_matryoshka(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "llama")
    with pytest.raises(RequestError, match="dimensions=8 .*does not support"):
        embedding_params(read_model_pooling(folder), 8)


@pytest.mark.timeout(120)
def test_dimensions_truncate_then_normalise(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "qwen2")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]}))
    with make_llm(folder) as llm:
        with pytest.raises(RequestError, match="dimensions=8 is not one the model was trained for.*16, 32, 64"):
            llm.embed(PROMPTS[0], dimensions=8)
        (out,) = llm.embed(PROMPTS[0], dimensions=16)
        full = reference(folder, PROMPTS[0], "last", False)[:16]
        torch.testing.assert_close(torch.tensor(out.outputs.embedding, dtype=torch.float64), full / full.norm(),
                                   rtol=1e-4, atol=1e-5)


def test_unsupported_pooling_refused_at_load_naming_file_value_and_choices(tmp_path: Path) -> None:
    """Max pooling (sentence-transformers has it, corerun does not): the LLM does not load, and says why."""
    folder = make_tiny_model(tmp_path, "llama")
    write_sentence_transformers(folder, "max_tokens", True)
    with pytest.raises(ModelLoadError, match=r"1_Pooling/config.json: pooling modes \['pooling_mode_max_tokens'\] are set; "
                                             r"corerun pools with exactly one of \['pooling_mode_lasttoken'"):
        make_llm(folder)


def test_pooling_files_corerun_cannot_follow_name_the_field(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "llama")
    write_sentence_transformers(folder, "mean_tokens", True)
    config_file = folder / "1_Pooling" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "include_prompt": False}))
    with pytest.raises(ModelLoadError, match="include_prompt=False .*include_prompt must be true or absent"):
        read_model_pooling(folder)
    (folder / "modules.json").write_text(json.dumps(["0_Transformer"]))
    with pytest.raises(ModelLoadError, match=r"modules.json: must be a list of modules .*got \["):
        read_model_pooling(folder)


def test_dimensions_beyond_the_hidden_size_refused(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "qwen2")  # hidden size 64
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    pooling = read_model_pooling(folder)
    assert embedding_params(pooling, 64).pooling.dimensions == 64
    with pytest.raises(RequestError, match="dimensions=65 is more than the model's 64 values per vector; ask for 1 to 64"):
        embedding_params(pooling, 65)
