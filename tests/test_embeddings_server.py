"""POST /v1/embeddings driven by the openai client against the real server: vectors equal transformers'
pooled hidden states, base64 equal to float, bad inputs answered 400 naming the field."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from corerun.testing import assert_idle, make_llm
from tests.helpers.serving import SERVING, http, metric, running_server, tiny_chat_model
from tests.test_embeddings import reference, write_sentence_transformers

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    folder = tiny_chat_model(tmp_path_factory.mktemp("embed-server"))
    write_sentence_transformers(folder, "mean_tokens", True)
    llm = make_llm(folder, **SERVING)
    with running_server(llm) as url:
        yield folder, llm, url


@pytest.mark.timeout(120)
def test_openai_client_embeddings_equal_transformers(served) -> None:
    folder, llm, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
    texts = ["hello world", "the cat sat on the mat"]
    ids = [llm.get_tokenizer().encode(t) for t in texts]
    for given in (texts, ids, ids[1]):
        resp = client.embeddings.create(input=given, model=Path(folder).name, encoding_format="float")
        want_ids = [ids[1]] if given is ids[1] else ids
        assert [d.index for d in resp.data] == list(range(len(want_ids)))
        for d, tokens in zip(resp.data, want_ids):
            got = torch.tensor(d.embedding, dtype=torch.float64)
            torch.testing.assert_close(got, reference(folder, tokens, "mean", True), rtol=1e-4, atol=1e-5)
        n = sum(len(t) for t in want_ids)
        assert (resp.usage.prompt_tokens, resp.usage.total_tokens) == (n, n)
    assert_idle(llm, timeout=5)


@pytest.mark.timeout(120)
def test_base64_decodes_to_the_float_vectors(served) -> None:
    _, _, url = served
    body = {"input": ["hello world", "the cat sat"]}
    status, floats = http(url + "/v1/embeddings", {**body, "encoding_format": "float"})
    assert status == 200, floats
    status, packed = http(url + "/v1/embeddings", {**body, "encoding_format": "base64"})
    assert status == 200, packed
    for f, b in zip(floats["data"], packed["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.asarray(f["embedding"], dtype=np.float32))


@pytest.mark.timeout(60)
def test_metrics_count_embedding_requests_and_their_prompt_tokens(served) -> None:
    _, llm, url = served
    texts = ["one two three", "a much longer sentence than that one"]
    tokens = sum(len(llm.get_tokenizer().encode(t)) for t in texts)

    def scrape() -> tuple[float, float, float, float]:
        status, text = http(url + "/metrics")
        assert status == 200
        return (metric(text, "vllm:prompt_tokens_total"), metric(text, "corerun:embedding_requests_total", finished_reason="stop"),
                metric(text, "vllm:request_success_total", finished_reason="stop"),
                metric(text, "corerun:requests_rejected_total", reason="invalid"))

    before = scrape()
    assert http(url + "/v1/embeddings", {"input": texts})[0] == 200
    assert http(url + "/v1/embeddings", {"input": ""})[0] == 400  # refused: counted as rejected, not as a request
    after = scrape()
    assert [a - b for a, b in zip(after, before)] == [tokens, 2, 2, 1]


@pytest.mark.parametrize("body, field", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [1.5, 2]}, "input"),
    ({"input": "hi", "dimensions": 8}, "dimensions"),
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "hi", "pooling": "max"}, "pooling"),
    ({"input": [[3] * 200]}, "input"),  # longer than max_model_len (128)
    ({"input": [[10 ** 7]]}, "input"),  # a token id outside the vocabulary
])
def test_bad_inputs_name_the_field(served, body: dict, field: str) -> None:
    _, _, url = served
    status, answer = http(url + "/v1/embeddings", body)
    assert status == 400, answer
    assert answer["error"]["param"] == field, json.dumps(answer)
    assert answer["error"]["message"].split(":")[0].startswith(field) or field in answer["error"]["message"]


def test_inputs_ended_without_a_vector_answer_503_at_shutdown_else_500() -> None:
    from corerun.outputs import EmbeddingOutput, EmbeddingRequestOutput
    from corerun.server.embeddings import error_of

    def out(reason: str) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput("r", None, [1, 2], EmbeddingOutput([0.5] if reason == "stop" else []), True,
                                      reason, None if reason != "error" else "plugin x failed")

    assert error_of([out("stop"), out("stop")]) is None
    cut = error_of([out("stop"), out("abort")])
    assert (cut.status, cut.code) == (503, "shutting_down") and "retry" in cut.message
    failed = error_of([out("stop"), out("error")])
    assert failed.status == 500 and failed.message.startswith("input 1:") and "plugin x failed" in failed.message
