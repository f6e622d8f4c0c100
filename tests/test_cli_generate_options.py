"""``corerun generate`` on the built-in default model: --chat prints the answer alone; --n, --stop and
--json-schema reach the request (known greedy answers of SmolLM2-135M-Instruct)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from corerun.cli import cli


def _lines(args: list[str]) -> list[str]:
    result = CliRunner().invoke(cli, ["generate", "--temperature", "0", *args])
    assert result.exit_code == 0, result.output
    return [line for line in result.output.splitlines() if not line.startswith(("INFO ", "corerun:"))]


def test_chat_prints_the_answer_alone() -> None:
    question = "What is the capital of France?"
    lines = _lines(["--chat", "--max-tokens", "16", question])
    assert lines == ["The capital of France is Paris."]


def test_n_completions_each_ending_before_the_stop_string() -> None:
    # greedy, unstopped: "The capital of France is Paris.\n\nThe answer is: ..."
    lines = _lines(["--n", "3", "--stop", ".", "--max-tokens", "16", "The capital of France is"])
    assert lines == ["The capital of France is Paris"] * 3


def test_json_schema_constrains_the_output(tmp_path) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
    path = tmp_path / "city.json"
    path.write_text(json.dumps(schema))
    prompt = "The capital of France as JSON:"
    (line,) = _lines(["--json-schema", f"@{path}", "--max-tokens", "24", prompt])
    assert json.loads(line.removeprefix(prompt)) == {"city": "Paris"}


def test_a_bad_json_schema_names_the_option_and_the_fix() -> None:
    result = CliRunner().invoke(cli, ["generate", "--json-schema", "{city: str}", "hi"])
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "--json-schema" in text and "not JSON" in text and "@schema.json" in text
    listed = CliRunner().invoke(cli, ["generate", "--json-schema", "[1, 2]", "hi"])
    assert listed.exit_code == 2 and "a JSON schema is an object, got list" in " ".join(listed.output.split())
