"""``corerun generate`` on the built-in default model: streaming output, and a refused prompt printed alone."""

from __future__ import annotations

from click.testing import CliRunner

from corerun.cli import cli


def test_streams_the_prompt_then_its_continuation() -> None:
    result = CliRunner().invoke(cli, ["generate", "--temperature", "0", "--max-tokens", "3", "The capital of France is"])
    assert result.exit_code == 0, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("The capital of France is") and len(line) > len("The capital of France is")


def test_a_refused_prompt_is_not_printed_before_its_error() -> None:
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    result = CliRunner().invoke(cli, ["generate", "--set", "scheduler.max_model_len=8", "--max-tokens", "2", prompt])
    assert result.exit_code == 1
    assert result.output.startswith("Error:"), result.output
    assert "max_model_len" in result.output and prompt not in result.output
