"""Structured output with text past ASCII (accents, CJK, characters outside the Basic Multilingual Plane
such as "😀" and "𝄞") through ``LLM.generate`` with the default model: a choice comes back as exactly
one of the strings asked for, a regex output matches (``re.fullmatch``), a JSON output parses and
validates (``jsonschema``) and holds the very strings of its ``enum`` / ``const``.  One engine, one
generate call."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from corerun import LLM, SamplingParams
from corerun.sampling_params import StructuredOutputsParams

# one choice alone: greedy decoding must spell it exactly
SINGLE = ["😀", "𝄞", "naïve café", "日本語のテキスト", "mixed 😀 é 中 𝄞!", 'a "quoted"\nline\\']
CHOICES = ["🍎 apple", "🍌 banana", "🍒 cherry", "plain"]
REGEXES = [r"(😀|é){2}x", r"[😀-😂]{3}", r"𝄞[a-c]{2}中"]
SCHEMAS = [
    {"type": "object", "properties": {"mood": {"enum": ["😀", "😢", "ü"]}, "clef": {"const": "𝄞 treble"}},
     "required": ["mood", "clef"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"enum": ["Zürich", "東京", "🏙 Metropolis"]}},
     "required": ["city"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def outputs() -> dict[str, list[str]]:
    specs: dict[str, list[StructuredOutputsParams]] = {
        "single": [StructuredOutputsParams(choice=[c]) for c in SINGLE],
        "choices": [StructuredOutputsParams(choice=CHOICES)],
        "regex": [StructuredOutputsParams(regex=r) for r in REGEXES],
        # a schema as a dict, and as a JSON string with ASCII escapes ("\ud83d\ude00"), as clients send it
        "json": [StructuredOutputsParams(json=SCHEMAS[0]), StructuredOutputsParams(json=json.dumps(SCHEMAS[1]))],
    }
    flat = [(kind, so) for kind, sos in specs.items() for so in sos]
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=so) for _, so in flat]
    with LLM(device="cpu", dtype="float32", attention="torch", kv_cache={"num_blocks": 256, "block_size": 16}) as llm:
        results = llm.generate(["Answer:"] * len(flat), params, use_tqdm=False)
    out: dict[str, list[str]] = {k: [] for k in specs}
    for (kind, _), r in zip(flat, results):
        c = r.outputs[0]
        assert c.finish_reason == "stop" and c.error is None, (kind, c.text, c.finish_reason, c.error)
        assert "\ufffd" not in c.text, (kind, c.text)
        out[kind].append(c.text)
    return out


def test_a_single_choice_comes_back_exactly(outputs: dict[str, list[str]]) -> None:
    assert outputs["single"] == SINGLE


def test_a_choice_among_several_is_one_of_them(outputs: dict[str, list[str]]) -> None:
    assert outputs["choices"][0] in CHOICES


def test_regex_outputs_match(outputs: dict[str, list[str]]) -> None:
    for pattern, text in zip(REGEXES, outputs["regex"]):
        assert re.fullmatch(pattern, text), (pattern, text)


def test_json_outputs_validate_and_keep_the_strings(outputs: dict[str, list[str]]) -> None:
    for schema, text in zip(SCHEMAS, outputs["json"]):
        value = json.loads(text)
        jsonschema.validate(value, schema)
    assert json.loads(outputs["json"][0])["clef"] == "𝄞 treble"


@pytest.mark.parametrize("field, value, named", [
    ("choice", ["ok", "a\ud800"], "structured_outputs.choice[1]"),
    ("regex", "x\udc00+", "structured_outputs.regex"),
    ("json", {"enum": ["\ud83d"]}, "structured_outputs.json"),
])
def test_a_lone_surrogate_is_refused_naming_the_field(field: str, value: object, named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named) + " must be valid Unicode text, got a lone surrogate"):
        StructuredOutputsParams(**{field: value})
