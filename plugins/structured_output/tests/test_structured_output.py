"""Structured output with the default model (SmolLM2-135M): every constrained output parses and
validates (``jsonschema``) or matches (``re.fullmatch``), and constrained rows leave the greedy outputs
of unconstrained rows in the same batch as they are alone.  One engine, three generate calls."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from corerun import LLM, RequestError, SamplingParams

SCHEMAS = [
    {  # nested objects, integer bounds, a bounded string
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                          "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                        "required": ["city", "zip"], "additionalProperties": False},
        },
        "required": ["name", "address"], "additionalProperties": False,
    },
    {  # enums
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}},
        "required": ["color", "size"], "additionalProperties": False,
    },
    {  # an array of bounded integers, bounded length
        "type": "object",
        "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                                  "minItems": 1, "maxItems": 4}},
        "required": ["scores"], "additionalProperties": False,
    },
    {  # numbers with bounds, a boolean
        "type": "object",
        "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 50},
                       "rank": {"type": "integer", "minimum": 1, "maximum": 10}, "ok": {"type": "boolean"}},
        "required": ["temperature", "rank", "ok"], "additionalProperties": False,
    },
    {  # an array of objects with an enum each
        "type": "array",
        "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                   "kind": {"enum": ["cat", "dog"]}},
                  "required": ["id", "kind"], "additionalProperties": False},
        "minItems": 1, "maxItems": 3,
    },
]
PER_SCHEMA = 4  # sampled outputs per schema (seeds 0-3): each schema reached through several paths
PROMPTS = ["A person and their address as JSON:", "A T-shirt as JSON:", "Test scores as JSON:", "Weather as JSON:",
           "Pets as JSON:"]
UNCONSTRAINED = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm():
    with LLM(device="cpu", dtype="float32", attention="torch", kv_cache={"num_blocks": 1024, "block_size": 16},
             scheduler={"max_num_seqs": 64}) as engine:
        yield engine


def test_json_schemas_validate_and_unconstrained_greedy_unchanged(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12)
    alone = [o.outputs[0].token_ids for o in llm.generate(UNCONSTRAINED, greedy, use_tqdm=False)]
    prompts, params = list(UNCONSTRAINED), [greedy, greedy]
    for i, schema in enumerate(SCHEMAS):
        for seed in range(PER_SCHEMA):
            prompts.append(PROMPTS[i])
            params.append(SamplingParams(temperature=0.7, seed=seed, max_tokens=160, structured_outputs={"json": schema}))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs[:2]] == [list(t) for t in alone]
    bad = []
    for k, out in enumerate(outs[2:]):
        schema, c = SCHEMAS[k // PER_SCHEMA], out.outputs[0]
        try:
            jsonschema.validate(json.loads(c.text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            bad.append((k, c.finish_reason, c.text, str(exc)[:120]))
        if c.finish_reason != "stop":
            bad.append((k, c.finish_reason, c.text, "did not end with stop"))
    assert not bad, bad


def test_choice_and_regex_always_match(llm):
    choices = ["yes", "no", "maybe later", 'a "quoted" one']
    regex = r"[A-Z]{2}-\d{3}(-[a-z]{1,4})?"  # bounded: the grammar ends, so every request ends with stop
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, structured_outputs={"choice": choices}) for s in range(8)]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=24, structured_outputs={"regex": regex}) for s in range(8)]
    params += [SamplingParams(temperature=1.0, seed=s, n=3, max_tokens=24, structured_outputs={"regex": r"(ab|cd)+e"}) for s in range(2)]
    outs = llm.generate(["Answer:"] * 8 + ["Licence plate:"] * 8 + ["Word:"] * 2, params, use_tqdm=False)
    texts = [[c.text for c in o.outputs] for o in outs]
    assert all(t[0] in choices for t in texts[:8]), texts[:8]
    assert all(re.fullmatch(regex, t[0]) for t in texts[8:16]), texts[8:16]
    assert all(len(t) == 3 and all(re.fullmatch(r"(ab|cd)+e", x) for x in t) for t in texts[16:]), texts[16:]
    assert [c.finish_reason for o in outs for c in o.outputs] == ["stop"] * 22, texts
    assert llm.engine.runner.logits_processors.num_requests == 0  # every state freed


def test_bad_grammar_refused_alone_with_the_compilers_message(llm):
    with pytest.raises(RequestError, match=r"structured_outputs.regex does not compile: .*Unclosed '\['"):
        llm.generate(["x"], SamplingParams(structured_outputs={"regex": "[a-"}), use_tqdm=False)
    with pytest.raises(RequestError, match=r"structured_outputs.grammar does not compile: .*"):
        llm.generate(["x"], SamplingParams(structured_outputs={"grammar": "root ::= "}), use_tqdm=False)
    out = llm.generate(["Answer:"], SamplingParams(max_tokens=4, structured_outputs={"choice": ["ok"]}), use_tqdm=False)
    assert out[0].outputs[0].text == "ok"
    # with ignore_eos the end-of-sequence token does not stop it, the finished grammar does
    out = llm.generate(["Answer:"], SamplingParams(max_tokens=10, ignore_eos=True, structured_outputs={"choice": ["ok"]}),
                       use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.token_ids[-1]) == ("ok", "stop", llm.get_tokenizer().eos_token_id)


def test_preempted_requests_keep_their_grammar():
    """A KV cache too small for the batch preempts (recomputes) requests mid-grammar: their outputs
    still validate, and each sample's state survives it."""
    schema = SCHEMAS[2]
    with LLM(device="cpu", dtype="float32", attention="torch", kv_cache={"num_blocks": 14, "block_size": 8},
             scheduler={"max_num_seqs": 8}) as small:
        params = [SamplingParams(temperature=0.7, seed=s, max_tokens=48, structured_outputs={"json": schema}) for s in range(6)]
        outs = small.generate([PROMPTS[2]] * 6, params, use_tqdm=False)
        assert small.engine.scheduler.num_preemptions > 0
        for out in outs:
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
        assert small.engine.runner.logits_processors.num_requests == 0


def test_grammars_compile_on_the_callers_thread_not_the_engines(llm, monkeypatch):
    import threading

    import xgrammar

    threads = []
    real = xgrammar.GrammarCompiler.compile_regex

    def spy(self, *args, **kwargs):
        threads.append(threading.current_thread())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(xgrammar.GrammarCompiler, "compile_regex", spy)
    out = llm.generate(["Code:"], SamplingParams(max_tokens=8, structured_outputs={"regex": "z{2}[0-9]"}), use_tqdm=False)
    assert re.fullmatch("z{2}[0-9]", out[0].outputs[0].text)
    assert threads == [threading.current_thread()]  # once (then cached), never on the engine loop's thread
