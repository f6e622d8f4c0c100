"""``corerun bench --compare``: the orchestration and reporting around peer processes, with fake peers.

The fake worker below stands in for vLLM / llama.cpp / transformers: a tiny script that speaks the
worker protocol (request file in, result file out) with elapsed times and outputs the test chooses,
so the ratios, the order of the interleaved runs and the error handling are checked against values
worked out here, without any real engine and without timing anything.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from corerun.bench.compare import (
    BASELINE, GGUF_DIR, PeerError, build_compare_report, build_request, compare, compare_model_dir, find_python, kv_cache_gib,
    llamacpp_gguf, parse_compare,
    parse_env, parse_peer_pythons, render_compare, result_from_json,
)
from corerun.bench.report import base_report
from corerun.bench.workload import make_workload

FAKE_WORKER = r'''
import json
import os
import sys
sys.path.insert(0, {protocol_dir!r})
import peer_protocol


def run(req):
    fake = req["options"]
    with open(fake["order_log"], "a") as f:
        f.write(req["engine"] + "\n")
    # an engine's n-th run takes fake["elapsed"][n] (a worker keeps no state: its runs so far are in the log)
    with open(fake["order_log"]) as f:
        nth = f.read().split().count(req["engine"]) - 1
    if fake.get("fail"):
        sys.stderr.write("peer exploded: " + fake["fail"] + "\n")
        raise SystemExit(3)
    outs = [[fake["token"]] * n for n in req["output_lens"]]
    if fake.get("short"):
        outs[0] = outs[0][:-1]
    elapsed = fake["elapsed"][nth] if isinstance(fake["elapsed"], list) else fake["elapsed"]
    result = {{
        "engine": req["engine"], "version": "9.9", "elapsed_s": elapsed, "load_s": 0.5, "output_token_ids": outs,
        "ttft_s": fake.get("ttft", []), "tpot_s": fake.get("tpot", []), "threads": req["threads"], "peak_rss_bytes": 1, "details": {{"kind": "fake", "mark": os.environ.get("FAKE_MARK"), "policy": os.environ.get("GOMP_SPINCOUNT")}},
    }}
    if fake.get("drop"):
        del result[fake["drop"]]
    return result


if __name__ == "__main__":  # written directly, so that the parent's checks of a bad result are the ones tested
    result = run(peer_protocol.read_request(sys.argv[1]))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
'''


@pytest.fixture
def fake(tmp_path: Path):
    protocol_dir = Path(__file__).resolve().parents[1] / "corerun" / "bench" / "peers"
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER.format(protocol_dir=str(protocol_dir)))
    return worker, tmp_path / "order.log"


WORKLOAD = make_workload(4, "5:9", "2:6", seed=3, vocab_size=100)


def _requests(engines, log: Path, **per_engine):
    out = {}
    for name in engines:
        opts = {"order_log": str(log), "token": 1, "elapsed": 1.0, **per_engine.get(name, {})}
        env = {"FAKE_MARK": f"set for {name}"} if name == BASELINE else None
        out[name] = build_request(name, WORKLOAD, model_dir="m", dtype="float32", threads=1, temperature=0.0, warmup=True,
                                  max_model_len=64, vocab_size=100, gguf=None, options=opts, env=env)
    return out


def _compare(engines, fake, rounds=1, **per_engine):
    worker, log = fake
    requests = _requests(engines, log, **per_engine)
    pythons = {name: Path(sys.executable) for name in engines}
    results = compare(engines, requests, pythons, WORKLOAD, rounds=rounds, workers={n: worker for n in engines})
    return results, log


def test_rounds_interleave_every_engine_in_order(fake):
    _, log = _compare(["corerun", "hf", "vllm"], fake, rounds=3)
    assert log.read_text().split() == ["corerun", "hf", "vllm"] * 3


def test_report_ratios_best_round_and_same_outputs(fake):
    n_out = WORKLOAD.num_output_tokens
    results, _ = _compare(
        ["corerun", "vllm", "llama.cpp"], fake, rounds=2,
        corerun={"elapsed": [2.0, 1.6], "ttft": [0.1, 0.3], "tpot": [0.02, 0.04, 0.06]},
        vllm={"elapsed": [0.8, 0.9], "token": 2, "ttft": [0.05], "tpot": [0.01]},
        **{"llama.cpp": {"elapsed": [4.0, 3.2]}},
    )
    doc = build_compare_report(results, base_report(WORKLOAD, temperature=0.0, warmup=True))
    core, vllm, llama = (doc["engines"][n] for n in ("corerun", "vllm", "llama.cpp"))
    # the fastest round of each engine is its summary
    assert core["elapsed_s"] == 1.6 and vllm["elapsed_s"] == 0.8 and llama["elapsed_s"] == 3.2
    assert [r["output_tokens_per_s"] for r in core["rounds"]] == pytest.approx([n_out / 2.0, n_out / 1.6])
    assert core["ms_per_output_token"] == pytest.approx(1600 / n_out)
    assert doc["ratio"]["vllm"]["output_tokens_per_s"] == pytest.approx(0.8 / 1.6)
    assert doc["ratio"]["llama.cpp"]["output_tokens_per_s"] == pytest.approx(3.2 / 1.6)
    assert doc["ratio"]["llama.cpp"]["ms_per_output_token"] == pytest.approx(1.6 / 3.2)
    assert doc["ratio"]["vllm"]["ttft_median"] == pytest.approx(0.2 / 0.05)  # median of 0.1, 0.3
    assert doc["ratio"]["vllm"]["tpot_median"] == pytest.approx(0.04 / 0.01)
    assert doc["ratio"]["llama.cpp"]["tpot_median"] is None  # llama.cpp's fake timed no request
    # vllm's fake answers token 2 everywhere, corerun's and llama.cpp's token 1
    assert vllm["same_outputs_as_corerun"] == 0 and llama["same_outputs_as_corerun"] == WORKLOAD.num_seqs
    assert vllm["version"] == "9.9" and vllm["threads"] == 1 and doc["skipped"] == {}
    assert all(len(r["loadavg_before"]) == 3 for r in core["rounds"])


def test_a_failing_peer_is_skipped_with_its_error(fake):
    results, log = _compare(["corerun", "vllm", "hf"], fake, rounds=2, vllm={"fail": "no AVX-512 here"})
    assert log.read_text().split() == ["corerun", "vllm", "hf", "corerun", "hf"]  # not tried again
    doc = build_compare_report(results, base_report(WORKLOAD, temperature=0.0, warmup=True))
    assert set(doc["engines"]) == {"corerun", "hf"}
    assert "exit status 3" in doc["skipped"]["vllm"] and "no AVX-512 here" in doc["skipped"]["vllm"]


def test_corerun_failing_is_an_error(fake):
    with pytest.raises(PeerError, match="corerun failed"):
        _compare(["corerun", "hf"], fake, corerun={"fail": "boom"})


@pytest.mark.parametrize("bad, message", [({"short": True}, "exactly the requested output lengths"),
                                          ({"drop": "elapsed_s"}, "result without elapsed_s"),
                                          ({"elapsed": 0.0}, "elapsed_s=0.0")])
def test_unusable_peer_results_are_rejected(fake, bad, message):
    results, _ = _compare(["corerun", "vllm"], fake, vllm=bad)
    assert results["vllm"].runs == [] and message in results["vllm"].skipped


def test_result_from_json_keeps_the_workload_counts():
    doc = {"engine": "x", "version": "1", "elapsed_s": 2.0, "load_s": 1.0, "threads": 4, "peak_rss_bytes": 123,
           "output_token_ids": [[5] * n for n in WORKLOAD.output_lens], "ttft_s": [0.5], "tpot_s": [0.25], "details": {"a": 1}}
    r = result_from_json("x", doc, WORKLOAD)
    assert r.output_tokens_per_s == pytest.approx(WORKLOAD.num_output_tokens / 2.0)
    assert r.prompt_tokens == WORKLOAD.num_prompt_tokens and r.details == {"a": 1, "version": "1", "threads": 4}
    assert r.to_dict()["ttft_ms"]["median"] == pytest.approx(500.0)


def test_render_compare_prints_ratios_and_skips(fake):
    from rich.console import Console

    results, _ = _compare(["corerun", "hf"], fake, corerun={"elapsed": 2.0}, hf={"elapsed": 4.0})
    doc = build_compare_report(results, base_report(WORKLOAD, temperature=0.0, warmup=True))
    doc.update(dtype="float32", threads=1, rounds=1, loadavg_after=[0.5, 0.25, 0.125], skipped={"vllm": "vllm is not installed"})
    console = Console(record=True, width=200)
    render_compare(doc, console)
    text = console.export_text()
    assert "2.00x" in text and "vllm skipped: vllm is not installed" in text and "0.50, 0.25, 0.12" in text


@pytest.mark.parametrize("text, expected", [("hf", ["hf"]), ("vllm, llama.cpp,hf", ["vllm", "llama.cpp", "hf"]),
                                            ("llamacpp,transformers,hf", ["llama.cpp", "hf"]), ("", [])])
def test_parse_compare(text, expected):
    assert parse_compare(text) == expected


def test_parse_compare_and_peer_python_reject():
    with pytest.raises(ValueError, match="'tgi'"):
        parse_compare("hf,tgi")
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_peer_pythons(["vllm"])
    assert parse_peer_pythons(["llamacpp=/x/python"]) == {"llama.cpp": Path("/x/python")}


def test_find_python(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_python("hf", {}) == Path(sys.executable)
    with pytest.raises(PeerError, match="--peer-python nosuch"):
        find_python("nosuch", {})
    python = tmp_path / "benchmarks" / "peers" / ".venvs" / "vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    assert find_python("vllm", {}) == python
    with pytest.raises(PeerError, match="no such file"):
        find_python("vllm", {"vllm": tmp_path / "missing"})


def test_request_carries_the_workload():
    req = build_request("vllm", WORKLOAD, model_dir="m", dtype="bfloat16", threads=2, temperature=0.0, warmup=False,
                        max_model_len=64, vocab_size=100, gguf=Path("/g.gguf"), options={})
    assert req["prompts"] == WORKLOAD.prompts and req["output_lens"] == WORKLOAD.output_lens
    assert req["warmup_prompt"] is None and req["gguf"] == "/g.gguf" and json.loads(json.dumps(req)) == req


def test_llamacpp_runs_the_gguf_file_corerun_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    q4 = tmp_path / "model.Q4_1.gguf"
    assert llamacpp_gguf(str(q4), "float32", None) == q4  # the same file, quantized as it is
    assert llamacpp_gguf(str(q4), "float32", Path("/other.gguf")) == Path("/other.gguf")  # --gguf wins
    assert llamacpp_gguf(str(tmp_path / "folder"), "float32", None) is None  # a folder: llama.cpp needs --gguf
    made = tmp_path / GGUF_DIR / "SmolLM2-135M-Instruct-F32.gguf"  # the default model: setup.sh's file in the dtype
    made.parent.mkdir(parents=True)
    made.write_bytes(b"")
    assert llamacpp_gguf(None, "float32", None) == made


def test_compare_reads_the_folder_corerun_loads(tmp_path, monkeypatch):
    """A Hub id is its local snapshot for the peers too (as corerun resolves it), a folder is itself, and
    no model is the default model's float folder."""
    from corerun.models import default, hub

    snapshot, folder = tmp_path / "snapshot", tmp_path / "folder"
    monkeypatch.setattr(hub, "resolve_model", lambda m: str(snapshot) if m == "org/tiny" else m)
    monkeypatch.setattr(default, "default_model_dir", lambda: tmp_path / "default")
    assert compare_model_dir("org/tiny") == (snapshot, None)
    assert compare_model_dir(str(folder)) == (folder, None)
    assert compare_model_dir(None) == (tmp_path / "default", None)


def test_baseline_runs_with_its_environment(fake, monkeypatch):
    monkeypatch.delenv("FAKE_MARK", raising=False)
    results, log = _compare(["corerun", BASELINE], fake, rounds=2)
    assert log.read_text().split() == ["corerun", BASELINE] * 2
    assert [r.details["mark"] for r in results[BASELINE].runs] == [f"set for {BASELINE}"] * 2
    assert [r.details["mark"] for r in results["corerun"].runs] == [None, None]
    assert parse_env(["CORERUN_CPU_PREPACK=0", "A_B="]) == {"CORERUN_CPU_PREPACK": "0", "A_B": ""}
    for bad in ("NOVALUE", "=1", "A-B=1"):
        with pytest.raises(ValueError, match="NAME=VALUE"):
            parse_env([bad])


def test_peers_start_without_the_openmp_policy_corerun_set(fake, monkeypatch):
    from corerun.platform import host

    # corerun's import put its spin count into this process's environment: no engine inherits it (corerun sets it
    # again itself)
    monkeypatch.setitem(host._SET_BY_PREPARE, "GOMP_SPINCOUNT", str(host.SPIN_COUNT))
    monkeypatch.setenv("GOMP_SPINCOUNT", str(host.SPIN_COUNT))
    results, _ = _compare(["corerun", BASELINE], fake)
    assert {name: r.runs[0].details["policy"] for name, r in results.items()} == {"corerun": None, BASELINE: None}
    # a spin count the user chose reaches every engine
    monkeypatch.setenv("GOMP_SPINCOUNT", "777")
    results, _ = _compare(["corerun", BASELINE], fake)
    assert {name: r.runs[0].details["policy"] for name, r in results.items()} == {"corerun": "777", BASELINE: "777"}
    env = {"GOMP_SPINCOUNT": str(host.SPIN_COUNT), "OMP_WAIT_POLICY": "PASSIVE", "PATH": "/bin"}
    assert host.environment_for_others(env) == {"OMP_WAIT_POLICY": "PASSIVE", "PATH": "/bin"}


def test_vllm_refuses_float32_for_a_w8a8_folder_before_starting(monkeypatch):
    """vLLM-CPU's int8 kernel takes bfloat16 or float16 activations: float32 is refused naming the fix."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "corerun" / "bench" / "peers"))
    import vllm_worker

    w8a8 = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "int"}, "input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}}}}
    w8a16 = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "int"}, "input_activations": None}}}}
    with pytest.raises(RuntimeError, match=r"dtype float32: .*W8A8 checkpoint \(m\) in bfloat16 or float16 only.*--dtype bfloat16"):
        vllm_worker._check_dtype({"dtype": "float32", "model_dir": "m"}, w8a8)
    vllm_worker._check_dtype({"dtype": "bfloat16", "model_dir": "m"}, w8a8)
    vllm_worker._check_dtype({"dtype": "float32", "model_dir": "m"}, w8a16)
    vllm_worker._check_dtype({"dtype": "float32", "model_dir": "m"}, {})


def test_every_engine_gets_the_kv_cache_the_workload_needs(monkeypatch):
    """One figure for vLLM's VLLM_CPU_KVCACHE_SPACE and corerun's kv_cache.cpu_memory_gb: twice the workload's
    tokens (plus 16k) at the model's K/V bytes per token, so neither engine preempts; a budget the user set wins."""
    from corerun.config import load_config

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "corerun" / "bench" / "peers"))
    import corerun_worker

    big = make_workload(128, "64:512", "64:256", seed=0, vocab_size=100)
    tokens = sum(map(len, big.prompts)) + sum(big.output_lens)
    # the default model: 30 layers, 3 KV heads of 64; float32 K and V are 46,080 bytes a token
    want = -(-2 * (tokens + 16384) * 46080 // 2**30)
    assert want > 2  # more than corerun's own default budget, which preempted in this workload
    assert kv_cache_gib(big, 30, 3, 64, "float32") == want
    assert kv_cache_gib(big, 30, 3, 64, "bfloat16") == -(-2 * (tokens + 16384) * 23040 // 2**30)
    assert kv_cache_gib(make_workload(1, "4", "4", seed=0, vocab_size=100), 1, 1, 8, "float32") == 1
    req = build_request("vllm", big, model_dir="m", dtype="float32", threads=1, temperature=0.0, warmup=False,
                        max_model_len=800, vocab_size=100, gguf=None, options={}, kv_cache_gib=want)
    assert req["kv_cache_gib"] == want
    cfg = load_config()
    corerun_worker.apply_kv_budget(cfg, want)
    assert cfg.kv_cache.cpu_memory_gb == want
    for sets in (["kv_cache.cpu_memory_gb=3"], ["kv_cache.num_blocks=100"]):
        cfg = load_config(sets=sets)
        corerun_worker.apply_kv_budget(cfg, want)
        assert cfg.kv_cache.cpu_memory_gb == (3.0 if "cpu" in sets[0] else 2.0)
    cfg = load_config()
    corerun_worker.apply_kv_budget(cfg, None)
    assert cfg.kv_cache.cpu_memory_gb == 2.0
