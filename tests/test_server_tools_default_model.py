"""The built-in default model (SmolLM2-135M-Instruct) behind ``corerun serve``, driven by the ``openai`` client:
its embeddings equal transformers' own hidden states (float64, last token, normalised, as the model's folder
states by having no sentence-transformers files), and tool calls work although its chat template renders no
``tools``: the definitions reach the model in a system message, and ``required`` / named choices are enforced,
so the arguments always parse.  One engine for the whole module (loading the model is the cost)."""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from corerun import LLM  # noqa: E402
from corerun.models import default_model_dir  # noqa: E402
from corerun.models.default import MODEL_NAME  # noqa: E402
from tests.helpers.serving import ENGINE, running_server  # noqa: E402
from tests.test_server_tools import ASK, SCHEMAS, TOOLS  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[LLM, Any]]:
    llm = LLM(**ENGINE, kv_cache={"block_size": 16, "num_blocks": 64}, scheduler={"max_model_len": 1024})
    with running_server(llm) as url:
        yield llm, openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)


def test_embeddings_equal_transformers_hidden_states(served: tuple[LLM, Any]) -> None:
    from transformers import AutoModel

    llm, client = served
    texts = ["The capital of France is", "Embeddings from the same server that chats."]
    resp = client.embeddings.create(input=texts, model=MODEL_NAME)
    tok = llm.get_tokenizer()
    ids = [tok.encode(t) for t in texts]
    assert resp.usage.prompt_tokens == sum(map(len, ids))
    model = AutoModel.from_pretrained(str(default_model_dir(progress=False)), torch_dtype=torch.float64).eval()
    for d, tokens in zip(resp.data, ids):
        with torch.no_grad():
            last = model(torch.tensor([tokens])).last_hidden_state[0, -1]
        torch.testing.assert_close(torch.tensor(d.embedding, dtype=torch.float64), last / last.norm(),
                                   rtol=1e-4, atol=2e-5)


def _tools_prompt(tok: Any, messages: list[dict[str, Any]]) -> int:
    """The prompt's length as transformers renders it with the tools in a first system message (docs/serving.md)."""
    system = "You can call these tools; each line is one tool's definition in JSON:\n" + "\n".join(
        json.dumps(t) for t in TOOLS)
    text = tok.apply_chat_template([{"role": "system", "content": system}, *messages], tokenize=False,
                                   add_generation_prompt=True)
    return len(tok.encode(text, add_special_tokens=False))


def test_required_and_named_calls_parse_with_the_tools_in_the_prompt(served: tuple[LLM, Any]) -> None:
    llm, client = served
    tok = llm.get_tokenizer()
    assert "tools" not in tok.chat_template  # the template ignores tools=: corerun writes them itself
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=60, temperature=0)
        (call,) = r.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.usage.prompt_tokens == _tools_prompt(tok, ASK)
    # the call and its result fed back: the call is written as the text `required` makes the model write
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    r = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=2,
                                       tool_choice="none")
    assert r.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(
        [*ASK, {"role": "assistant", "content": '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}]'},
         {"role": "tool", "content": "21 degrees"}], tokenize=False, add_generation_prompt=True), add_special_tokens=False))
    # auto needs a parser, and the template names none
    with pytest.raises(openai.BadRequestError, match="chat template renders no tools"):
        client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=4)
