"""The ``lora`` plugin kind: the built-in and first-party kernels registered and listed, ``lora.kernel: auto``
choosing by device and CUDA-graph safety, and ``corerun new lora NAME`` writing a kernel that passes
``corerun conformance lora:NAME`` unedited."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from corerun.cli import cli
from corerun.conformance import run
from corerun.plugin.registry import Registry
from corerun.protocols.lora import LoRAKernelCapabilities, LoRANeed


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.from_environment()


def test_hook_corerun_lora_kernels(registry: Registry) -> None:
    kernels = registry.registrations["lora"]
    assert {"torch", "grouped", "triton"} <= set(kernels)
    assert kernels["torch"].distribution == kernels["grouped"].distribution == "corerun"
    assert kernels["triton"].distribution == "corerun-attention-triton"
    assert kernels["torch"].capabilities.graph_safe and not kernels["grouped"].capabilities.graph_safe
    assert kernels["triton"].capabilities.graph_safe and kernels["triton"].capabilities.max_rank == 128


def test_auto_picks_grouped_on_cpu_torch_under_cuda_graphs_and_triton_on_cuda(registry: Registry) -> None:
    assert registry.select("lora", "auto", LoRANeed("cpu"), "lora.kernel").name == "grouped"
    assert registry.select("lora", "auto", LoRANeed("cpu", graphs=True), "lora.kernel").name == "torch"
    eligible, passed = registry.auto_ranking("lora", LoRANeed("cuda", dtype="bfloat16", graphs=True))
    assert eligible[0].name == "triton"
    assert dict((r.name, why) for r, why in passed)["grouped"].endswith("it is not graph_safe")
    eligible, passed = registry.auto_ranking("lora", LoRANeed("cuda", dtype="float32", max_rank=256))
    assert eligible[0].name == "torch"
    assert "max_lora_rank 256 above its largest rank 128" in dict((r.name, why) for r, why in passed)["triton"]


def test_corerun_plugins_lists_the_kind() -> None:
    done = CliRunner().invoke(cli, ["plugins", "--json", "--no-probe"])
    assert done.exit_code == 0, done.output
    listed = {(r["kind"], r["name"]): r for r in json.loads(done.output)["implementations"]}
    assert listed[("lora", "grouped")]["capabilities"]["grouped"] is True
    assert {("lora", "torch"), ("lora", "triton")} <= set(listed)


def test_scaffolded_kernel_passes_the_suite_unedited(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    done = CliRunner().invoke(cli, ["new", "lora", "fresh", "--dir", str(tmp_path)])
    assert done.exit_code == 0, done.output
    assert "corerun conformance lora:fresh" in done.output
    root = tmp_path / "corerun-lora-fresh"
    assert "`lora: {kernel: fresh}`" in (root / "README.md").read_text()
    monkeypatch.syspath_prepend(str(root))
    import corerun_lora_fresh.plugin as entry_point
    from corerun_lora_fresh.kernel import Kernel
    from corerun_lora_fresh.plugin import CAPABILITIES

    assert isinstance(CAPABILITIES, LoRAKernelCapabilities)
    own = Registry()
    own.register_module(entry_point, plugin="lora_fresh", distribution="corerun-lora-fresh", version="0.1.0")
    assert own.load_errors == [] and own.get("lora", "fresh").capabilities is CAPABILITIES
    results = run("lora", factory=Kernel, capabilities=CAPABILITIES, name="fresh")
    outcomes = {r.id: r.outcome for r in results}
    assert all(o == "passed" for i, o in outcomes.items() if "graph_replay" not in i), outcomes
    assert len([i for i in outcomes if "mixed" in i]) == 9  # 3 dtypes x one slice, q/k/v, gate/up
    for module in [m for m in sys.modules if m.startswith("corerun_lora_fresh")]:
        monkeypatch.delitem(sys.modules, module)
