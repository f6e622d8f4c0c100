"""``benchmarks/gpu/run.sh`` rehearsed on CPU: its control flow, its prerequisite checks, the results
files its parts write as they go, how they come back (``$OUT`` receives ``summary.txt`` and one
``gpu-results.tgz``, also when a part or the whole script is killed), and the time plan written at its top.

The script runs on a lent GPU for a few minutes at a time; these tests keep it from rotting unseen.
``--dry-run`` runs every part with the real command lines (argument parsing, engine settings,
``corerun bench`` options) but no CUDA work; ``CORERUN_GPU_DRY_HANG`` makes one rehearsed check hang
so the time limits and the naming of a hung check are exercised for real.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_SH = ROOT / "benchmarks" / "gpu" / "run.sh"
PREFLIGHT = ROOT / "benchmarks" / "gpu" / "preflight.py"
PLAN = ["bench-graphs", "conformance-graph", "conformance-triton", "kv-profile", "conformance-rest", "bench-attention", "bench-e2e"]
JSON = {
    "bench-graphs": "bench_graphs.json", "conformance-graph": "conformance-graph.json",
    "conformance-triton": "conformance-triton.json", "kv-profile": "kv_profile.json",
    "conformance-rest": "conformance-rest.json", "bench-attention": "bench_attention.json", "bench-e2e": "bench_e2e.json",
}


def script_env(tmp: Path, wheels: Path | None = None, **env: str) -> dict[str, str]:
    """``$OUT`` is ``tmp/out`` (what a lent machine's tool brings back), the scratch folder ``tmp/scratch``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("CORERUN_GPU_", "PART_LIMIT"))}
    environ.update(OUT=str(tmp / "out"), PYTHON=sys.executable, CORERUN_GPU_SCRATCH=str(tmp / "scratch"), **env)
    environ["CORERUN_GPU_WHEELS"] = str(wheels or tmp / "no-wheels")
    return environ


def run_script(tmp: Path, *args: str, wheels: Path | None = None, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(RUN_SH), *args], capture_output=True, text=True,
                          env=script_env(tmp, wheels, **env), timeout=timeout)


def returned(tmp: Path) -> Path:
    """The folder of results as the tool brings it back: ``$OUT`` must hold exactly the summary and the
    archive (the tool returns at most 8 files); the archive is unpacked and its folder returned."""
    out = tmp / "out"
    assert sorted(p.name for p in out.iterdir()) == ["gpu-results.tgz", "summary.txt"]
    with tarfile.open(out / "gpu-results.tgz") as tar:
        names = tar.getnames()
        assert all(n == "gpu-results" or n.startswith("gpu-results/") for n in names), names
        tar.extractall(tmp / "unpacked", filter="data")
    folder = tmp / "unpacked" / "gpu-results"
    assert (folder / "summary.txt").read_text() == (out / "summary.txt").read_text()
    return folder


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def part_files(part: str) -> set[str]:
    """The files a rehearsed part leaves: its log and its results document."""
    return {f"{part}.log", JSON[part]}


def start_until_hang(tmp: Path, command: list[str], hang: str, within: float) -> subprocess.Popen:
    """Start the rehearsal ``command`` with ``hang`` made to hang (a check of bench-attention), and
    return once that part's results say it is running ``hang``; fail if it does not within ``within`` s."""
    proc = subprocess.Popen(command, env=script_env(tmp, CORERUN_GPU_DRY_HANG=hang),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    running = tmp / "scratch" / "gpu-results" / "bench_attention.json"
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if load(running)["running"] == hang:
                return proc
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"the rehearsal never reached {hang!r}: {proc.communicate()}")


def test_dry_run_rehearses_every_part_in_plan_order(tmp_path: Path) -> None:
    proc = run_script(tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = returned(tmp_path)
    summary = (results / "summary.txt").read_text()
    assert summary.startswith("preflight ok"), summary
    assert proc.stdout.endswith(summary)  # printed last
    assert re.fullmatch(r"== done in \d+ s; every part passed", summary.splitlines()[-1]), summary
    files = {p.name for p in results.iterdir()}
    assert set().union(*(part_files(p) for p in PLAN)) <= files, files
    assert {"preflight.json", "install.log", "install-wheels.txt", "kv_profile.torch.json", "kv_profile.triton.json"} <= files
    started = re.findall(r"^== ([\w-]+) \(limit", summary, re.M)
    assert started == ["install", *PLAN]
    assert summary.count("   ok in ") == len(PLAN) + 1, summary
    for part in PLAN:
        doc = load(results / JSON[part])
        assert doc["dry_run"] is True and doc["status"] == "passed", (part, doc)
        assert doc["running"] is None and doc["checks"], part
        assert all(c["ok"] is True for c in doc["checks"]), part
    # the real command lines were checked: every corerun bench configuration parsed, the KV-profile settings loaded
    e2e = load(results / "bench_e2e.json")
    assert [c["name"] for c in e2e["checks"]] == ["triton+cuda (+hf)", "triton+eager", "torch+cuda", "torch+eager"]
    triton = [c["name"] for c in load(results / "conformance-triton.json")["checks"]]
    assert triton[-3:] == ["lora:triton", "pytest tests/test_models_moe_triton.py::test_triton_experts_equal_a_dense_per_expert_reference",
                           "pytest tests/test_quantization_int_gemm_triton.py"]
    graphs = [c["name"] for c in load(results / "bench_graphs.json")["checks"]]
    assert "torch: capture" in graphs and "triton: capture" in graphs
    # each engine of the KV profile in a process of its own
    parent = load(results / "kv_profile.json")
    engines = {b: load(results / f"kv_profile.{b}.json") for b in ("torch", "triton")}
    pids = {parent["pid"], engines["torch"]["pid"], engines["triton"]["pid"]}
    assert len(pids) == 3
    assert all(e["checks"][0]["name"].endswith("engine settings are valid") and e["checks"][0]["ok"] for e in engines.values())
    # nothing installed, but what would be is shown
    install_log = (results / "install.log").read_text()
    assert "would run:" in install_log and "--no-build-isolation -e ." in install_log


DEVICE_CALL_S = 600  # the device tool's longest call (timeout_s)
KILL_GRACE_S = 5  # `timeout -k 5`: a part that ignores SIGTERM dies 5 s after its limit
# Cold Triton cache (nothing compiled on a fresh machine): the least each part needs, from the
# compile counts and times of the sm_90 compile check (issue 26)
COLD_CACHE_MIN = {"conformance-triton": 100, "conformance-rest": 45, "bench-attention": 45}
ENGINE_MIN_S = 40  # one KV-profile engine: first prefill autotune and the 4096-long split variants


def test_time_plan_at_the_top_matches_the_parts_and_fits_the_budget() -> None:
    text = RUN_SH.read_text()
    header = text[: text.index("set -u")]
    table = dict(re.findall(r"^#   ([a-z][\w-]+) +(\d+) ", header, re.M))
    calls = dict(re.findall(r"^\s*part ([\w-]+) (\d+) ", text, re.M))
    limits = {k: int(v) for k, v in table.items()}
    assert {k: int(v) for k, v in calls.items()} == {k: v for k, v in limits.items() if k != "preflight"}
    assert list(calls) == ["install", *PLAN]
    total = sum(limits.values())
    budget = int(re.search(r"BUDGET_S:-(\d+)", text).group(1))
    stated = int(re.search(r"^#\s+---\n#\s+(\d+)\s*$", header, re.M).group(1))
    assert stated == total == budget, (stated, total, budget)
    assert f"sum to BUDGET_S ({budget} s)" in header
    # the last part killed at the deadline, then 30 s to pack: inside one device call
    assert budget + KILL_GRACE_S + 30 <= DEVICE_CALL_S, budget
    assert all(limits[part] >= least for part, least in COLD_CACHE_MIN.items()), limits
    # the limits a part hands down fit inside the part's own limit
    engine = int(re.search(r"check_kv_profile\.py .*--engine-timeout (\d+)", text).group(1))
    assert engine >= ENGINE_MIN_S and limits["kv-profile"] >= 2 * (engine + KILL_GRACE_S), (engine, limits["kv-profile"])
    e2e = re.search(r"bench_e2e\.py .*--timeout (\d+) --hf-extra (\d+)", text)
    per_config, hf_extra = int(e2e.group(1)), int(e2e.group(2))
    assert per_config > 17 and limits["bench-e2e"] >= 4 * per_config + hf_extra, (per_config, hf_extra, limits["bench-e2e"])
    # docs/development.md states the same limits, part by part, and the one call that runs it all
    docs = (ROOT / "docs" / "development.md").read_text()
    documented = {k: int(v) for k, v in re.findall(r"^\| ([a-z][\w-]+) \| (\d+) s \|", docs, re.M)}
    assert documented == limits
    assert re.search(rf"no part\s+starts after {budget} s; the limits sum to {total} s", docs)
    call = re.search(r"^    run\(command=\"(.+)\", carry=(\[.*\]), timeout_s=(\d+)\)$", docs, re.M)
    assert call, "docs/development.md gives no one-call run(...) line"
    assert call.group(1) == "bash benchmarks/gpu/run.sh"
    assert json.loads(call.group(2)) == ["benchmarks/gpu/wheels"] and int(call.group(3)) == DEVICE_CALL_S


def test_missing_packages_stop_the_script_with_one_line(tmp_path: Path) -> None:
    proc = run_script(tmp_path, "--dry-run", CORERUN_GPU_PRETEND="pydantic=,rich=12.0,setuptools=70.3.0")
    assert proc.returncode == 3
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    line = lines[0]
    assert line.startswith("run.sh: cannot start:")
    assert "pydantic>=2.5" in line and "rich>=13 (have 12.0)" in line
    assert "setuptools 70.3.0 is older than 77" in line
    assert "carry" in line and "fetch_wheels.sh" in line and str(tmp_path / "no-wheels") in line
    results = returned(tmp_path)
    assert (results / "summary.txt").read_text() == line + "\n"
    assert {p.name for p in results.iterdir()} == {"summary.txt", "preflight.json", "install-wheels.txt"}


def _fake_wheel(folder: Path, name: str, requires: tuple[str, ...] = ()) -> Path:
    """A wheel file holding only its metadata (name, version and ``Requires-Dist`` lines)."""
    folder.mkdir(exist_ok=True)
    path = folder / name
    dist, version = name.split("-")[:2]
    lines = ["Metadata-Version: 2.1", f"Name: {dist}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{dist}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def run_preflight(out: Path, wheels: Path, pretend: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CORERUN_GPU_PRETEND": pretend}
    return subprocess.run([sys.executable, str(PREFLIGHT), "--out", str(out), "--dry-run", "--wheels", str(wheels)],
                          capture_output=True, text=True, env=env, timeout=60)


def test_carried_wheels_satisfy_the_check_and_only_missing_ones_are_installed(tmp_path: Path) -> None:
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheels = tmp_path / "wheels"
    wanted = {
        _fake_wheel(wheels, "pydantic-2.14.4-py3-none-any.whl", ("pydantic-core==2.50.5", 'email-validator>=2; extra == "email"')),
        _fake_wheel(wheels, f"pydantic_core-2.50.5-{here}-{here}-manylinux_2_17_{platform.machine()}.manylinux2014_{platform.machine()}.whl"),
        _fake_wheel(wheels, "rich-15.0.0-py3-none-any.whl"),
        _fake_wheel(wheels, "setuptools-80.9.0-py3-none-any.whl"),
    }
    _fake_wheel(wheels, "tqdm-4.70.1-py3-none-any.whl")  # installed here already: not reinstalled over the image's
    proc = run_script(tmp_path, "--dry-run", "--only", "install", wheels=wheels,
                      CORERUN_GPU_PRETEND="pydantic=,pydantic-core=,rich=,setuptools=70.3.0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = returned(tmp_path)
    listed = {Path(p) for p in (results / "install-wheels.txt").read_text().split()}
    assert listed == wanted
    pip_line = next(line for line in (results / "install.log").read_text().splitlines()
                    if "pip install --no-index --no-deps" in line and "--no-build-isolation" not in line)
    assert all(str(w) in pip_line for w in wanted) and "tqdm" not in pip_line


def test_a_carried_wheel_needing_a_newer_installed_package_is_caught_and_a_carried_newer_one_installed(tmp_path: Path) -> None:
    """Wheels install with --no-deps: what they require of other distributions is checked from their
    Requires-Dist against the image (pydantic needs a typing-extensions newer than some images ship)."""
    wheels = tmp_path / "wheels"
    pydantic = _fake_wheel(wheels, "pydantic-2.14.4-py3-none-any.whl", (
        "typing-extensions>=4.16", "annotated-types>=0.6.0", "pydantic-core==2.50.5",
        'email-validator>=2.0.0; extra == "email"', 'exceptiongroup>=1; python_version < "3.0"'))
    core = _fake_wheel(wheels, "pydantic_core-2.50.5-py3-none-any.whl", ("typing-extensions>=4.14.1",))
    pretend = "pydantic=,pydantic-core=,typing-extensions=4.12.2,annotated-types=0.7.0,email-validator=,exceptiongroup="
    proc = run_preflight(tmp_path, wheels, pretend)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    line = proc.stdout.strip()
    missing = line.removeprefix("run.sh: cannot start: missing ").split(": no wheel for them")[0]
    spec, why = re.fullmatch(r"typing-extensions(\S+) \((.*)\)", missing).groups()  # the one thing missing
    assert set(spec.split(",")) == {">=4.16", ">=4.14.1"}
    assert why == "have 4.12.2; needed by pydantic 2.14.4, pydantic-core 2.50.5"
    assert "email-validator" not in line and "exceptiongroup" not in line  # an extra, a marker false here
    newer = _fake_wheel(wheels, "typing_extensions-4.16.0-py3-none-any.whl")
    proc = run_preflight(tmp_path, wheels, pretend)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set((tmp_path / "install-wheels.txt").read_text().split()) == {str(pydantic), str(core), str(newer)}


def test_wheel_for_another_python_is_refused(tmp_path: Path) -> None:
    other = f"cp{sys.version_info.major}{sys.version_info.minor + 1}"
    wheels = tmp_path / "wheels"
    _fake_wheel(wheels, f"pydantic_core-2.50.5-{other}-{other}-manylinux_2_17_{platform.machine()}.whl")
    proc = run_preflight(tmp_path, wheels, "pydantic-core=")
    assert proc.returncode == 3
    assert f"is for {other}, this is Python" in proc.stdout
    assert not load(tmp_path / "preflight.json")["ok"]


def test_a_hung_check_is_named_and_later_parts_still_run(tmp_path: Path) -> None:
    proc = run_script(tmp_path, "--dry-run", "--only", "bench-graphs,conformance-graph",
                      CORERUN_GPU_DRY_HANG="triton: capture", PART_LIMIT_S="2")
    assert proc.returncode == 1
    results = returned(tmp_path)
    summary = (results / "summary.txt").read_text()
    assert "TIMED OUT after 2 s" in summary and "stopped in: triton: capture" in summary
    assert proc.stdout.endswith(summary)
    assert summary.splitlines()[-1].endswith("; some part failed or timed out; cut by their limit: bench-graphs"), summary
    assert {p.name for p in results.iterdir()} == {"summary.txt", *part_files("bench-graphs"), *part_files("conformance-graph")}
    doc = load(results / "bench_graphs.json")
    assert doc["status"] == "killed" and doc["killed_in"] == "triton: capture"
    done = {c["name"]: c["ok"] for c in doc["checks"]}
    assert done["torch: capture"] is True and done["triton: build the model"] is True  # measured before the hang: kept
    assert done["triton: capture"] is False and "triton: time batch 1" not in done
    assert load(results / "conformance-graph.json")["status"] == "passed"  # the next part ran


def test_timeout_killing_the_script_still_brings_back_every_result(tmp_path: Path) -> None:
    """``timeout`` ends the whole script while a part hangs: the script stops that part (which marks
    its results killed), packs the archive and prints the summary before it exits."""
    hang = "prefill 2048 tokens"  # in bench-attention, the part before the last
    proc = start_until_hang(tmp_path, ["timeout", "300", "bash", str(RUN_SH), "--dry-run"], hang, within=150)
    proc.send_signal(signal.SIGALRM)  # timeout's own limit expiring: SIGTERM to the script and its group
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 124, stdout + stderr  # timeout's status when it killed the command
    results = returned(tmp_path)
    summary = (results / "summary.txt").read_text()
    assert stdout.endswith(summary)
    assert summary.splitlines()[-1].startswith("== run.sh stopped by SIGTERM after ")
    assert summary.splitlines()[-1].endswith(" s (in bench-attention); no part started after that"), summary
    assert "   STOPPED by SIGTERM after" in summary and f"stopped in: {hang}" in summary
    ran = PLAN[: PLAN.index("bench-attention") + 1]
    files = {p.name for p in results.iterdir()}
    assert set().union(*(part_files(p) for p in ran)) <= files, files
    assert "bench_e2e.json" not in files and "== bench-e2e" not in summary
    doc = load(results / "bench_attention.json")
    assert doc["status"] == "killed" and doc["killed_in"] == hang
    with pytest.raises(ProcessLookupError):  # the hung part was ended, not left behind
        os.kill(doc["pid"], 0)


def test_signals_repeated_while_the_script_winds_down_do_not_cut_the_summary(tmp_path: Path) -> None:
    """``timeout`` signals the script and then its whole process group, so the script may take a second
    SIGTERM while it stops the part and packs (CI once lost the summary that way); a user may press
    Ctrl-C twice. Here SIGTERM and SIGINT keep coming every 10 ms until the script exits: the first one
    names the stop and every later one is ignored until the summary is printed."""
    hang = "prefill 2048 tokens"
    proc = start_until_hang(tmp_path, ["bash", str(RUN_SH), "--dry-run", "--only", "bench-attention"], hang, within=60)
    sent = 0
    while proc.poll() is None and sent < 3000:
        proc.send_signal(signal.SIGINT if sent % 2 else signal.SIGTERM)
        sent += 1
        time.sleep(0.01)
    stdout, stderr = proc.communicate(timeout=30)
    assert sent >= 3, sent  # the script was still winding down when later signals came
    assert proc.returncode == 128 + signal.SIGTERM, stdout + stderr
    summary = (returned(tmp_path) / "summary.txt").read_text()
    assert stdout.endswith(summary), stdout
    assert summary.splitlines()[-1].startswith("== run.sh stopped by SIGTERM after "), summary
    assert "   STOPPED by SIGTERM after" in summary and f"stopped in: {hang}" in summary


def test_kv_profile_engine_past_its_timeout_names_its_step_and_the_other_engine_runs(tmp_path: Path) -> None:
    env = {**os.environ, "CORERUN_GPU_DRY_HANG": "torch: build the engine"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu" / "check_kv_profile.py"), "--out", str(tmp_path), "--dry-run", "--engine-timeout", "2"],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert proc.returncode == 1
    rows = load(tmp_path / "kv_profile.json")["results"]
    assert rows["torch"]["error"] == "timed out after 2 s in: torch: build the engine (profile, KV cache, graph capture)"
    assert "error" not in rows["triton"]
    assert load(tmp_path / "kv_profile.triton.json")["status"] == "passed"


def test_part_report_names_the_running_check_before_its_body_runs(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu.part_report import PartReport, summary_line

    path = tmp_path / "r.json"
    report = PartReport(path, "demo")
    with report.check("first") as entry:
        on_disk = load(path)
        assert on_disk["running"] == "first" and on_disk["checks"][-1] == {"name": "first", "ok": None}
        entry["ok"] = False
    with report.check("second", catch=True):
        raise ValueError("bad value 7")
    assert report.finish() == 1
    doc = load(path)
    assert doc["status"] == "failed" and doc["running"] is None
    assert doc["checks"][1]["error"] == "ValueError: bad value 7"
    assert summary_line(path) == "failed: 0/2 checks passed; failed: first, second"


def test_conformance_groups_enumerate_their_cuda_cases() -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from benchmarks.gpu.conformance_part import GROUPS, Tests, cases, node_ids, tests_unavailable

    for group, suites in GROUPS.items():
        for suite in suites:
            if isinstance(suite, Tests):
                continue
            _, target, selected = cases(suite, "cuda")
            if suite.optional:
                continue
            assert selected, (group, suite.label)
            assert all(c.device == "cuda" for c in selected)
    split = next(s for s in GROUPS["triton"] if not isinstance(s, Tests) and s.options)
    checks = {c.check for c in cases(split, "cuda")[2]}
    assert checks == {"decode", "mixed"}
    # the experts kernel, after lora:triton: its three top-k cases, refused where they would be interpreted
    labels = [s.label for s in GROUPS["triton"]]
    moe = GROUPS["triton"][labels.index("lora:triton") + 1]
    assert isinstance(moe, Tests) and [i.rpartition("[")[2] for i in node_ids(moe)] == ["1]", "2]", "4]"]
    assert all(i.startswith("tests/test_models_moe_triton.py::") for i in node_ids(moe))
    refused = tests_unavailable("cuda")
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        assert refused == []
    else:
        assert refused and all(r.endswith(("interpreted", "unset it")) for r in refused), refused


def test_a_tests_entry_reports_each_outcome_and_fails_the_part_on_a_failure(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu.conformance_part import PartReport, Tests, run_suite

    (tmp_path / "test_cases.py").write_text(
        "import pytest\n"
        "@pytest.fixture\n"
        "def broken():\n    raise OSError('no device 3')\n"
        "def test_ok():\n    pass\n"
        "def test_wrong():\n    assert 2 + 2 == 5, 'sum 4 is not 5'\n"
        "def test_setup(broken):\n    pass\n"
        "def test_skipped():\n    pytest.skip('needs 2 GPUs')\n"
        "@pytest.mark.xfail(reason='known', strict=True)\n"
        "def test_expected():\n    assert False\n"
    )
    report = PartReport(tmp_path / "part.json", "conformance-demo")
    assert run_suite(report, Tests(str(tmp_path / "test_cases.py")), "cpu") is False
    doc = load(tmp_path / "part.json")
    rows = {c["name"].rpartition("::")[2]: c for c in doc["checks"][1:]}
    assert {k: (r["outcome"], r["ok"]) for k, r in rows.items()} == {
        "test_ok": ("passed", True), "test_wrong": ("failed", False), "test_setup": ("error", False),
        "test_skipped": ("skipped", True), "test_expected": ("xfailed", True)}
    assert "sum 4 is not 5" in rows["test_wrong"]["reason"] and "no device 3" in rows["test_setup"]["reason"]
    entry = doc["results"][f"pytest {tmp_path / 'test_cases.py'}"]
    assert entry["planned"] == 5 and entry["ok"] is False
    assert entry["summary"] == {"passed": 1, "failed": 1, "error": 1, "skipped": 1, "xfailed": 1}


def test_every_build_system_requires_setuptools_77() -> None:
    files = [ROOT / "pyproject.toml", *sorted((ROOT / "plugins").glob("*/pyproject.toml"))]
    assert len(files) >= 5
    for f in files:
        table = re.search(r"^\[build-system\]\n(.*?)(?=^\[)", f.read_text(), re.S | re.M).group(1)
        assert re.search(r'"setuptools>=(\d+)', table).group(1) == "77", f


def test_hf_dtype_keyword_falls_back_to_torch_dtype_on_older_transformers() -> None:
    torch = pytest.importorskip("torch")
    from corerun.bench.hf_run import hf_with_dtype

    calls = []

    def old_loader(path: str, **kwargs):  # transformers < 4.56 hands dtype= on to the model's constructor
        calls.append(kwargs)
        if "dtype" in kwargs:
            raise TypeError("LlamaForCausalLM.__init__() got an unexpected keyword argument 'dtype'")
        return ("model", path, kwargs)

    assert hf_with_dtype(old_loader, "folder", dtype=torch.float16, attn_implementation="eager") == (
        "model", "folder", {"torch_dtype": torch.float16, "attn_implementation": "eager"})
    assert calls[0] == {"dtype": torch.float16, "attn_implementation": "eager"}

    def broken(path: str, **kwargs):
        raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")

    with pytest.raises(TypeError, match="unsupported operand"):
        hf_with_dtype(broken, "folder", dtype=torch.float16)
