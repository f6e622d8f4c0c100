"""``corerun bench``: the workload generator, the latency statistics, and the command end to end.

The statistics are checked against closed-form values worked out by hand below; the command runs
on a tiny random Llama with three requests (no timing is asserted, only the document's shape and
the token counts the workload fixes).
"""

from __future__ import annotations

import json
import math
import random

import pytest
from click.testing import CliRunner

from corerun.bench.memory import PeakMemoryMeter
from corerun.bench.stats import percentile, request_latencies, summarize
from corerun.bench.workload import TOKEN_ID_LIMIT, LengthRange, make_workload, parse_range, warmup_prompt
from corerun.cli import cli
from tests.helpers.tiny_models import make_tiny_model


# ------------------------------------------------------------------------------ workload
def test_workload_is_deterministic_for_a_seed():
    a = make_workload(32, "8:40", "3:9", seed=123, vocab_size=50_000)
    b = make_workload(32, LengthRange(8, 40), (3, 9), seed=123, vocab_size=50_000)
    c = make_workload(32, "8:40", "3:9", seed=124, vocab_size=50_000)
    assert a.prompts == b.prompts and a.output_lens == b.output_lens
    assert a.prompts != c.prompts


def test_workload_matches_an_independent_draw():
    # the documented draw order, replayed with the standard library: input length, its ids, output length
    rng = random.Random(7)
    expected_prompts, expected_outs = [], []
    for _ in range(5):
        n = rng.randint(4, 9)
        expected_prompts.append([rng.randrange(300) for _ in range(n)])
        expected_outs.append(rng.randint(2, 6))
    w = make_workload(5, "4:9", "2:6", seed=7, vocab_size=300)
    assert w.prompts == expected_prompts and w.output_lens == expected_outs


def test_workload_respects_ranges_and_vocabulary():
    w = make_workload(400, "5:17", "2:11", seed=3, vocab_size=97)
    lens = [len(p) for p in w.prompts]
    assert min(lens) == 5 and max(lens) == 17  # 400 draws from 13 values reach both ends
    assert min(w.output_lens) == 2 and max(w.output_lens) == 11
    ids = {t for p in w.prompts for t in p}
    assert min(ids) >= 0 and max(ids) < 97 and len(ids) > 90
    assert w.num_prompt_tokens == sum(lens) and w.num_output_tokens == sum(w.output_lens)
    big = make_workload(50, 64, 1, seed=0, vocab_size=10**6)
    assert all(len(p) == 64 for p in big.prompts) and big.output_lens == [1] * 50
    assert max(t for p in big.prompts for t in p) < TOKEN_ID_LIMIT


def test_warmup_prompt_differs_from_the_workload():
    w = make_workload(8, "16:32", "4:8", seed=5, vocab_size=1000)
    p = warmup_prompt(w, 1000)
    assert len(p) == 16 and p == warmup_prompt(w, 1000)
    assert all(p != q[:16] for q in w.prompts)


@pytest.mark.parametrize(
    "text, expected",
    [("32:128", (32, 128)), ("32 128", (32, 128)), ("64", (64, 64)), (7, (7, 7)), ((2, 3), (2, 3))],
)
def test_parse_range(text, expected):
    r = parse_range(text)
    assert (r.lo, r.hi) == expected


@pytest.mark.parametrize("text", ["128:32", "0:4", "a:b", "1:2:3", ""])
def test_parse_range_rejects(text):
    with pytest.raises(ValueError, match="MIN"):
        parse_range(text)


# ---------------------------------------------------------------------------- statistics
def test_percentile_closed_form():
    xs = list(range(1, 102))  # 1..101: the q-th percentile is exactly 1 + q
    random.Random(0).shuffle(xs)
    assert percentile(xs, 50) == 51 and percentile(xs, 90) == 91 and percentile(xs, 99) == 100
    assert percentile(xs, 0) == 1 and percentile(xs, 100) == 101
    # four values: rank q/100 * 3 interpolates between neighbours
    four = [10.0, 40.0, 20.0, 30.0]
    assert percentile(four, 50) == pytest.approx(25.0)  # rank 1.5
    assert percentile(four, 90) == pytest.approx(37.0)  # rank 2.7: 30 + 0.7 * 10
    assert percentile(four, 99) == pytest.approx(39.7)  # rank 2.97
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(four, 101)


def test_summarize_and_request_latencies_closed_form():
    # request i arrives at 0, gets its first token at 0.1 * (i + 1), and n_out = i + 2 tokens 0.02 s apart
    metrics, n_out = [], []
    for i in range(4):
        first = 0.1 * (i + 1)
        n = i + 2
        metrics.append({"arrival_time": 0.0, "first_token_time": first, "finish_time": first + 0.02 * (n - 1)})
        n_out.append(n)
    metrics.append({"arrival_time": 1.0, "first_token_time": 1.5, "finish_time": 1.5})  # one token: TTFT only
    n_out.append(1)
    ttft, tpot = request_latencies(metrics, n_out)
    assert ttft == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert tpot == pytest.approx([0.02] * 4)
    s = summarize(ttft)
    assert s["median"] == pytest.approx(0.3)
    assert s["p90"] == pytest.approx(0.46)  # rank 3.6: 0.4 + 0.6 * 0.1
    assert s["p99"] == pytest.approx(0.496)  # rank 3.96
    assert summarize([]) == {"median": None, "p90": None, "p99": None}


def test_peak_rss_meter_sees_an_allocation():
    import mmap

    meter = PeakMemoryMeter("cpu")
    meter.start()
    before = meter.read().bytes
    # 64 MiB of fresh anonymous pages, each touched: new resident memory whatever the allocator
    # already holds (a heap allocation may reuse pages freed earlier in the process)
    block = mmap.mmap(-1, 64 * 2**20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    after = meter.read()
    block.close()
    assert after.kind == "peak_rss" and after.bytes >= before + 60 * 2**20


# ------------------------------------------------------------------------------ command
JSON_KEYS = {"corerun_version", "machine", "workload", "corerun"}
RUN_KEYS = {
    "elapsed_s", "load_s", "prompt_tokens", "output_tokens", "output_tokens_per_s", "total_tokens_per_s",
    "ttft_ms", "tpot_ms", "peak_memory",
}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bench"), "llama")


def _run(args):
    result = CliRunner().invoke(cli, ["bench", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_bench_compare_hf_end_to_end(tiny_llama):
    # corerun and transformers, each in a fresh process (interleaving is checked with fake peers)
    doc = _run(["--model", str(tiny_llama), "--device", "cpu", "--attention", "torch", "--num-seqs", "3",
                "--input-len", "4", "12", "--output-len", "3:6", "--seed", "11", "--compare", "hf",
                "--threads", "1", "--json"])
    w = make_workload(3, "4:12", "3:6", seed=11, vocab_size=256)  # the tiny model's vocabulary
    assert doc["workload"]["prompt_tokens"] == w.num_prompt_tokens and doc["workload"]["output_tokens"] == w.num_output_tokens
    assert doc["workload"]["input_len"] == [4, 12] and doc["workload"]["num_seqs"] == 3
    assert set(doc["engines"]) == {"corerun", "hf"} and doc["skipped"] == {}
    assert doc["threads"] == 1 and doc["dtype"] == "float32" and doc["rounds"] == 1
    for side in ("corerun", "hf"):
        run = doc["engines"][side]
        assert RUN_KEYS <= set(run) and run["threads"] == 1 and len(run["rounds"]) == 1
        assert run["prompt_tokens"] == w.num_prompt_tokens and run["output_tokens"] == w.num_output_tokens
        assert run["output_tokens_per_s"] == pytest.approx(run["output_tokens"] / run["elapsed_s"])
        assert run["output_tokens_per_s"] == pytest.approx(max(r["output_tokens_per_s"] for r in run["rounds"]))
    c, hf = doc["engines"]["corerun"], doc["engines"]["hf"]
    assert c["ttft_ms"]["median"] > 0 and c["tpot_ms"]["median"] > 0
    assert c["backends"]["attention"] == "torch" and c["backends"]["device"] == "cpu"
    assert hf["batching"] == "batched" and hf["generated_tokens"] == 3 * max(w.output_lens)
    # greedy on the same float32 weights: transformers must produce the same tokens as corerun
    assert hf["same_outputs_as_corerun"] == 3
    assert doc["ratio"]["hf"]["output_tokens_per_s"] == pytest.approx(c["output_tokens_per_s"] / hf["output_tokens_per_s"])


def test_bench_json_without_comparison(tiny_llama):
    import torch

    threads = torch.get_num_threads()
    doc = _run(["--model", str(tiny_llama), "--device", "cpu", "--attention", "torch", "--num-seqs", "2",
                "--input-len", "5:9", "--output-len", "2", "--no-warmup", "--threads", "1", "--json"])
    assert set(doc) == JSON_KEYS
    assert doc["corerun"]["output_tokens"] == 4 and doc["workload"]["warmup"] is False
    assert doc["machine"]["torch_threads"] == 1 and torch.get_num_threads() == threads  # restored afterwards
    assert len(doc["machine"]["loadavg"]) == 3 and doc["machine"]["physical_cores"] >= 1


def test_bench_table(tiny_llama):
    result = CliRunner().invoke(cli, ["bench", "--model", str(tiny_llama), "--device", "cpu", "--attention", "torch",
                                      "--num-seqs", "2", "--input-len", "6", "--output-len", "3"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    for text in ("output tokens/s", "TTFT p99 (ms)", "TPOT median (ms)", "peak RSS (MiB)", "attention=torch", "threads: "):
        assert text in result.output


def test_bench_rejects_lengths_beyond_the_model(tiny_llama):
    result = CliRunner().invoke(cli, ["bench", "--model", str(tiny_llama), "--device", "cpu", "--attention", "torch",
                                      "--input-len", "200:250", "--output-len", "10:20", "--json"])
    assert result.exit_code != 0 and "max_model_len is 256" in result.output


def test_bench_rejects_an_unknown_peer(tiny_llama):
    result = CliRunner().invoke(cli, ["bench", "--model", str(tiny_llama), "--device", "cpu", "--compare", "hf,sglang"])
    assert result.exit_code != 0 and "'sglang'" in result.output and "hf, llama.cpp, vllm" in result.output


def test_bench_async_scheduling_both_reports_the_speedup(tiny_llama):
    """One engine, synchronous and asynchronous in turn: the ratio of its own throughputs, greedy outputs equal."""
    doc = _run(["--model", str(tiny_llama), "--device", "cpu", "--attention", "torch", "--num-seqs", "3",
                "--input-len", "4:10", "--output-len", "4:8", "--threads", "1", "--async-scheduling", "both",
                "--rounds", "2", "--json"])
    a = doc["async_scheduling"]
    assert a["rounds"] == 2 and len(a["sync_output_tokens_per_s"]) == len(a["async_output_tokens_per_s"]) == 2
    assert a["speedup"] == pytest.approx(max(a["async_output_tokens_per_s"]) / max(a["sync_output_tokens_per_s"]))
    assert a["speedup_per_round"] == pytest.approx([x / y for x, y in zip(a["async_output_tokens_per_s"], a["sync_output_tokens_per_s"])])
    assert a["same_outputs"] == 3 and len(a["loadavg_before_runs"]) == 4
    assert doc["corerun"]["output_tokens_per_s"] == pytest.approx(max(a["async_output_tokens_per_s"]))
    w = make_workload(3, "4:10", "4:8", seed=0, vocab_size=256)
    assert doc["corerun"]["output_tokens"] == w.num_output_tokens


def test_bench_async_scheduling_option_is_checked(tiny_llama):
    base = ["bench", "--model", str(tiny_llama), "--device", "cpu", "--attention", "torch", "--num-seqs", "2",
            "--input-len", "4", "--output-len", "2", "--no-warmup", "--threads", "1"]
    result = CliRunner().invoke(cli, [*base, "--async-scheduling", "both", "--compare", "hf"])
    assert result.exit_code != 0 and "--async-scheduling" in result.output and "--compare" in result.output
    result = CliRunner().invoke(cli, [*base, "--async-scheduling", "sometimes"])
    assert result.exit_code != 0 and "'on', 'off', 'both'" in result.output
    result = CliRunner().invoke(cli, [*base, "--async-scheduling", "on", "--set", "speculative.method=ngram", "--json"])
    assert result.exit_code == 0, result.output  # asynchronous scheduling runs with speculative decoding
    result = CliRunner().invoke(cli, [*base, "--async-scheduling", "on", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["corerun"]["output_tokens"] == 4


# ------------------------------------------------------------------ speculative decoding
def test_repetitive_workload_draw_order():
    # the documented draw order, replayed: per request 40 lines (word, word, number), then the output length
    from corerun.bench.workload import make_repetitive_workload

    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    w = make_repetitive_workload(2, "3:9", seed=4, encode=encode)
    rng = random.Random(4)
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec romeo sierra tango".split()
    for prompt, out_len in zip(w.prompts, w.output_lens):
        lines = [f"{i + 1}. {rng.choice(words)} {rng.choice(words)} {rng.randint(10, 99)}" for i in range(40)]
        text = "Here is a list:\n" + "\n".join(lines) + "\n\nCopy the list above exactly, line by line:\n" + lines[0] + "\n"
        assert prompt == encode(text) and out_len == rng.randint(3, 9)
    assert w.kind == "repetitive" and w.describe()["kind"] == "repetitive"
    assert (w.input_len.lo, w.input_len.hi) == (min(map(len, w.prompts)), max(map(len, w.prompts)))
    assert w.prompts[0] != w.prompts[1]


@pytest.fixture(scope="module")
def tiny_llama_with_tokenizer(tmp_path_factory):
    from tests.helpers.tiny_tokenizer import add_tiny_tokenizer

    # the copy-the-list prompts are ~600 tokens of the tiny tokenizer: room for them
    return add_tiny_tokenizer(make_tiny_model(tmp_path_factory.mktemp("bench-spec"), "llama", max_position_embeddings=1024))


@pytest.mark.parametrize("kind, temperature", [("random", "0"), ("repetitive", "0"), ("random", "1.0")])
def test_bench_speculative_both_reports_the_speedup(tiny_llama_with_tokenizer, kind, temperature):
    """One engine, drafts off and on in turn: the ratio of its throughputs, the same tokens (greedy, or seeded
    when sampling), and acceptance counts that add up."""
    args = ["--model", str(tiny_llama_with_tokenizer), "--device", "cpu", "--attention", "torch", "--num-seqs", "2",
            "--output-len", "24", "--threads", "1", "--speculative", "both", "--spec-tokens", "3",
            "--spec-lookup", "1:3", "--rounds", "2", "--workload", kind, "--temperature", temperature, "--json"]
    doc = _run(args + (["--input-len", "6:12"] if kind == "random" else []))
    s = doc["speculative"]
    assert (s["method"], s["num_tokens"], s["prompt_lookup_min"], s["prompt_lookup_max"]) == ("ngram", 3, 1, 3)
    assert s["rounds"] == 2 and len(s["off_output_tokens_per_s"]) == len(s["on_output_tokens_per_s"]) == 2
    assert s["speedup"] == pytest.approx(max(s["on_output_tokens_per_s"]) / max(s["off_output_tokens_per_s"]))
    assert s["speedup_per_round"] == pytest.approx([x / y for x, y in zip(s["on_output_tokens_per_s"], s["off_output_tokens_per_s"])])
    assert s["same_outputs"] == 2 and len(s["loadavg_before_runs"]) == 4
    assert doc["workload"]["kind"] == kind and doc["corerun"]["output_tokens"] == 48
    assert doc["corerun"]["output_tokens_per_s"] == pytest.approx(max(s["on_output_tokens_per_s"]))
    # every verified row carries 1..K drafts and accepts at most all of them
    assert s["num_drafts"] <= s["proposed"] <= 3 * s["num_drafts"] and 0 <= s["accepted"] <= s["proposed"]
    assert sum(s["proposed_per_round"]) == s["proposed"] and sum(s["accepted_per_round"]) == s["accepted"]
    if temperature == "0":  # greedy: each round is the same computation, so the same drafts
        assert s["proposed_per_round"][0] == s["proposed_per_round"][1] > 0
    if s["num_drafts"]:
        assert s["mean_accepted_length"] == pytest.approx(1 + s["accepted"] / s["num_drafts"])
        assert s["acceptance_rate"] == pytest.approx(s["accepted"] / s["proposed"])


def test_bench_speculative_options_are_checked(tiny_llama):
    base = ["bench", "--model", str(tiny_llama), "--device", "cpu", "--attention", "torch", "--num-seqs", "2",
            "--input-len", "4", "--output-len", "2", "--no-warmup", "--threads", "1"]

    def fails(*args):
        result = CliRunner().invoke(cli, [*base, *args])
        assert result.exit_code == 2, result.output  # click's usage error
        return result.output

    out = fails("--speculative", "maybe")
    assert "--speculative" in out and "'maybe'" in out and "'on', 'off', 'both'" in out
    out = fails("--speculative", "on", "--spec-tokens", "0")
    assert "--spec-tokens" in out and "1<=x<=64" in out
    out = fails("--speculative", "both", "--spec-lookup", "4:2")
    assert "--spec-lookup" in out and "'4:2'" in out and "MIN <= MAX" in out
    out = fails("--spec-tokens", "3")
    assert "--spec-tokens" in out and "--speculative on or both" in out
    out = fails("--speculative", "both", "--async-scheduling", "on")
    assert "--speculative both and --async-scheduling on cannot be combined" in out
    out = fails("--speculative", "both", "--compare", "hf")
    assert "--speculative" in out and "--compare" in out
    out = fails("--workload", "repetitive")  # base gives --input-len
    assert "--workload" in out and "--input-len" in out
    result = CliRunner().invoke(cli, ["bench", "--model", str(tiny_llama), "--device", "cpu", "--num-seqs", "1",
                                      "--output-len", "2", "--workload", "repetitive"])
    assert result.exit_code != 0 and "tokenizer" in result.output and "--workload random" in result.output
    # on / off on their own are config settings; off leaves async scheduling free
    result = CliRunner().invoke(cli, [*base, "--speculative", "off", "--async-scheduling", "on", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(cli, [*base, "--speculative", "on", "--spec-tokens", "2", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["corerun"]["output_tokens"] == 4


def test_set_speculative_needs_an_engine_built_with_it(tiny_llama):
    from corerun import LLM

    llm = LLM(model=str(tiny_llama), device="cpu", attention="torch")
    with pytest.raises(RuntimeError, match="speculative.method"):
        llm.engine.set_speculative(True)
    llm.engine.set_speculative(False)  # already off: nothing to refuse
    assert llm.engine.spec is None
    llm.shutdown()
