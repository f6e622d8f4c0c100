"""benchmarks/decode_path_trace.py: its line counting against a hand-counted source, and one traced
decode step whose report has the promised shape and covers the step's layers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trace_module():
    spec = importlib.util.spec_from_file_location("decode_path_trace", ROOT / "benchmarks" / "decode_path_trace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lines_of_code_skip_docstrings_comments_and_blanks(trace_module, tmp_path):
    src = tmp_path / "sample.py"
    src.write_text(
        "import os\n"                      # 1
        "\n"                               # 2
        "class A:\n"                       # 3
        "    def f(self, x):\n"            # 4  code
        '        """Doc\n'                 # 5
        '        string."""\n'             # 6
        "        # a comment\n"            # 7
        "\n"                               # 8
        "        y = [i for i in x]\n"     # 9  code
        "        return y\n"               # 10 code
        "\n"                               # 11
        "def g():\n"                       # 12 code
        "    def h():\n"                   # 13 code (g and h)
        "        return 1\n"               # 14 code (g and h)
        "    return h()\n"                 # 15 code
    )
    found = {name: (first, last, sorted(code)) for first, last, name, code in trace_module.functions_of(str(src))}
    assert found == {"A.f": (4, 10, [4, 9, 10]), "g": (12, 15, [12, 13, 14, 15]), "g.h": (13, 14, [13, 14])}
    assert trace_module.enclosing(str(src), 14)[2] == "g.h"
    assert trace_module.enclosing(str(src), 9)[2] == "A.f"
    assert trace_module.enclosing(str(src), 1) is None


@pytest.mark.timeout(120)
def test_one_traced_decode_step_has_the_promised_shape(trace_module, capsys):
    trace_module.main(["--json", "--attention", "torch", "--warmup", "1"])
    report = json.loads(capsys.readouterr().out)
    files, totals = report["files"], report["totals"]
    assert set(totals) == {"files", "functions", "lines", "executed", "moves"}
    assert totals["files"] == len(files)
    for key in ("functions", "lines", "executed"):
        assert totals[key] == sum(v[key] for v in files.values()), key
    for path, v in files.items():
        assert (ROOT / path).is_file(), path
        assert path.startswith(("corerun/", "plugins/")), path
        assert 0 < v["executed"] <= v["lines"], (path, v)
        assert len(v["names"]) == v["functions"] > 0, (path, v)
    # the step's layers are on the path: engine, scheduler, KV manager, runner, model, attention
    for path in ("corerun/engine/llm_engine.py", "corerun/core/scheduler.py", "corerun/kv_cache/paged.py",
                 "corerun/runner/model_runner.py", "corerun/models/llama.py", "corerun/attention/torch_backend.py"):
        assert path in files, f"{path} missing from the traced path: {sorted(files)}"
    assert "LLMEngine.step" in files["corerun/engine/llm_engine.py"]["names"]
    # a plain greedy decode takes the argmax without the sampler's processing stages
    assert "corerun/sampler/full.py" in files
    for path in ("corerun/sampler/penalties.py", "corerun/sampler/processors.py", "corerun/sampler/histories.py"):
        assert path not in files, f"{path} on the path of an all-greedy decode"
    # nor work nobody asked for: the eager runner's hop, logits processors, logprobs and stop strings,
    # Sequence's properties, the scheduler's admission, preemption and draft code; nor what is decided once:
    # the step's thread count (host.step_pools at load), a request's greedy flag, the sampler helpers' module
    for path in ("corerun/graph/eager.py", "corerun/runner/construction.py", "corerun/runner/logits_processing.py",
                 "corerun/engine/output_processor.py", "corerun/core/sequence.py", "corerun/platform/host.py",
                 "corerun/sampling_params.py", "corerun/sampler/common.py"):
        assert path not in files, f"{path} on the path of a plain decode: {files[path]['names']}"
    assert not {"Scheduler._admit", "Scheduler._make_room", "Scheduler._schedule_drafts", "_verified"} & set(
        files["corerun/core/scheduler.py"]["names"])
    # nor the code for requests new to the runner, embedding requests or failed rows
    for path, names in (("corerun/core/batch.py", {"Told._new_request"}), ("corerun/runner/input_batch.py", {"InputBatch._add"}),
                        ("corerun/runner/model_runner.py", {"ModelRunner._pool_plan", "ModelRunner._pool"}),
                        ("corerun/engine/llm_engine.py", {"LLMEngine._fail_rows"})):
        assert not names & set(files[path]["names"]), (path, files[path]["names"])
    assert totals["moves"] >= totals["files"] - 1


@pytest.mark.timeout(120)
def test_the_cpu_backend_reads_its_layer_windows_once(trace_module, capsys):
    """The cpu attention backend (the documented walk's) keeps each layer's window from construction, so
    a decode's per-layer forward never calls back into the spec (``protocols/attention.py``)."""
    pytest.importorskip("corerun_attention_cpu")
    from corerun_attention_cpu import kernels

    lib, why = kernels.load()
    if lib is None:
        pytest.skip("; ".join(why))
    trace_module.main(["--json", "--attention", "cpu", "--warmup", "1"])
    files = json.loads(capsys.readouterr().out)["files"]
    assert "plugins/attention_cpu/corerun_attention_cpu/backend.py" in files
    assert "corerun/protocols/attention.py" not in files, files.get("corerun/protocols/attention.py")
