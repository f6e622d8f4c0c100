"""``corerun bench --lora N``: the workload over N random adapters against the base alone, in one run."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from corerun.cli import cli
from corerun.testing.tiny_models import make_tiny_model


@pytest.mark.timeout(120)
def test_bench_lora_reports_the_cost_against_the_base_and_runs_the_adapters(tmp_path):
    model = make_tiny_model(tmp_path, arch="llama")
    args = ["bench", "--model", str(model), "--device", "cpu", "--attention", "torch", "--num-seqs", "4",
            "--input-len", "6", "--output-len", "4", "--lora", "3", "--rounds", "1", "--json",
            "--set", "lora.max_lora_rank=8", "--set", "kv_cache.num_blocks=64"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lora = json.loads(result.stdout)["lora"]
    assert (lora["num_adapters"], lora["rank"], lora["max_loras"]) == (3, 8, 3)
    assert lora["base_output_tokens_per_s"][0] > 0 and lora["lora_output_tokens_per_s"][0] > 0
    assert lora["speedup"] == pytest.approx(lora["lora_output_tokens_per_s"][0] / lora["base_output_tokens_per_s"][0])
    assert lora["same_outputs"] < 4  # the adapters ran: greedy tokens differ from the base model's
    assert lora["slot_bytes"] > 0
    bad = CliRunner().invoke(cli, [*args[:11], "--lora", "2", "--url", "http://127.0.0.1:1"])
    assert bad.exit_code != 0 and "--lora sets up corerun in this process" in bad.output
