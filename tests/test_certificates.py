"""A certificate names the code it proved (corerun.plugin.trust): the installed files' digest (wheel RECORD, or
an editable install's package sources), the distribution, corerun and protocol versions, torch's version
and the device kind.  Any difference, and ``auto`` passes the implementation over saying why; a failing
run of ``corerun conformance`` revokes it."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

from corerun import hookimpl
from corerun.plugin import trust
from corerun.plugin.capabilities import AttentionCapabilities, GraphRunnerCapabilities, Need
from corerun.cli import cli
from corerun.plugin.registry import Registry
from tests.test_registry import Provides, Recorder, builtins_only

NEED = Need("cpu", attention=AttentionCapabilities(cuda_graph_decode=True))
DIST = "corerun-graph-turbo"


@pytest.fixture(autouse=True)
def _certificates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORERUN_CACHE_DIR", str(tmp_path / "cache"))  # no certificate from elsewhere counts


def turbo_registry() -> Registry:
    """The built-ins and a third-party graph runner 'turbo' (priority 50) from ``corerun-graph-turbo``."""
    caps = GraphRunnerCapabilities(devices=frozenset({"cpu"}))
    return builtins_only((Provides(graph=[("turbo", Recorder(), {"capabilities": caps, "priority": 50})]), "turbo", DIST))


def _record_line(path: str, content: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(content)}"


def install_wheel(site: Path, kernel: bytes) -> Path:
    """What pip leaves of a wheel of corerun-graph-turbo 1.2.3 whose kernel file is ``kernel``: the
    files and a dist-info whose RECORD lists each with its hash (plus pip's own unhashed entries)."""
    (site / "turbo_pkg").mkdir(parents=True, exist_ok=True)
    (site / "turbo_pkg" / "kernel.py").write_bytes(kernel)
    info = site / "corerun_graph_turbo-1.2.3.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: corerun-graph-turbo\nVersion: 1.2.3\n")
    (info / "RECORD").write_text("\n".join([
        _record_line("turbo_pkg/kernel.py", kernel),
        "turbo_pkg/__pycache__/kernel.cpython-311.pyc,,",
        _record_line(f"{info.name}/METADATA", (info / "METADATA").read_bytes()),
        f"{info.name}/RECORD,,",
    ]) + "\n")
    return site


def install_editable(site: Path, src: Path) -> None:
    """An editable install of corerun-graph-turbo 1.2.3 whose package ``turbo_pkg`` lives in ``src``."""
    (src / "turbo_pkg").mkdir(parents=True)
    (src / "turbo_pkg" / "__init__.py").write_text("")
    (src / "turbo_pkg" / "plugin.py").write_text("# hooks\n")
    (src / "turbo_pkg" / "kernel.py").write_text("def run(x):\n    return x\n")
    info = site / "corerun_graph_turbo-1.2.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: corerun-graph-turbo\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text("[corerun]\nturbo = turbo_pkg.plugin\n")
    (info / "direct_url.json").write_text(json.dumps({"url": src.as_uri(), "dir_info": {"editable": True}}))
    (info / "RECORD").write_text(f"{info.name}/METADATA,,\n")


def why_passed_over(reg: Registry) -> str:
    chosen = reg.select("graph", "auto", NEED)
    assert chosen.name != "turbo"
    return dict((r.name, w) for r, w in chosen.passed_over)["turbo"]


def test_a_certificate_names_the_code_and_environment_it_proved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(install_wheel(tmp_path / "site", b"def run(x):\n    return x\n")))
    reg = turbo_registry()
    path = trust.record_certificate(reg.get("graph", "turbo"), "cpu", {"passed": 3})
    doc = json.loads(path.read_text())
    record = (tmp_path / "site" / "corerun_graph_turbo-1.2.3.dist-info" / "RECORD").read_text().splitlines()
    hashed = sorted(line.rsplit(",", 1)[0] for line in record if line.split(",")[1])  # path,sha256=...
    assert doc["files_digest"] == hashlib.sha256("\n".join(hashed).encode()).hexdigest()
    assert doc["files_from"] == "wheel RECORD" and doc["distribution_version"] == "1.2.3"
    assert doc["corerun_version"] == trust.__version__ and doc["protocol_version"] == trust.PROTOCOL_VERSION
    import torch

    assert doc["torch_version"] == torch.__version__ and doc["device_kind"].startswith("cpu ")
    assert reg.select("graph", "auto", NEED).name == "turbo"


def test_same_version_with_other_files_is_not_certified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = install_wheel(tmp_path / "site", b"def run(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(site))
    reg = turbo_registry()
    trust.record_certificate(reg.get("graph", "turbo"), "cpu", {"passed": 3})
    assert reg.select("graph", "auto", NEED).name == "turbo"
    install_wheel(site, b"def run(x):\n    return x * 0\n")  # a broken build reinstalled as the same 1.2.3
    why = why_passed_over(reg)
    assert why.startswith("third-party, its certificate is for other code (installed files changed since the run (wheel RECORD: ")
    assert why.endswith("run `corerun conformance graph:turbo` again")


def test_an_edited_editable_install_is_not_certified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    install_editable(tmp_path / "site", src)
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    reg = turbo_registry()
    trust.record_certificate(reg.get("graph", "turbo"), "cpu", {"passed": 3})
    assert reg.select("graph", "auto", NEED).name == "turbo"
    (src / "turbo_pkg" / "__pycache__").mkdir()
    (src / "turbo_pkg" / "__pycache__" / "kernel.cpython-311.pyc").write_bytes(b"bytecode")  # not source: no change
    assert reg.select("graph", "auto", NEED).name == "turbo"
    (src / "turbo_pkg" / "kernel.py").write_text("def run(x):\n    return -x\n")  # same version, edited
    why = why_passed_over(reg)
    assert f"installed files changed since the run (editable source {src / 'turbo_pkg'}: " in why
    (src / "turbo_pkg" / "kernel.py").write_text("def run(x):\n    return x\n")  # the certified code again
    assert reg.select("graph", "auto", NEED).name == "turbo"


@pytest.mark.parametrize("change, expected", [
    ("corerun", "corerun version {old} -> 9.9.9"),
    ("torch", "torch version {old} -> 9.9.9"),
    ("device", "device {old} -> cpu riscv64"),
    ("distribution", "distribution version 1.2.3 -> 1.2.4"),
])
def test_another_corerun_torch_device_or_version_is_not_certified(change: str, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    reg = turbo_registry()
    turbo = reg.get("graph", "turbo")
    trust.record_certificate(turbo, "cpu", {"passed": 3})
    assert reg.select("graph", "auto", NEED).name == "turbo"
    old = {"corerun": trust.__version__, "torch": trust.version_of("torch"), "device": trust.device_kind("cpu")}.get(change)
    if change == "corerun":
        monkeypatch.setattr(trust, "__version__", "9.9.9")
    elif change == "torch":
        real = trust.version_of
        monkeypatch.setattr(trust, "version_of", lambda d: "9.9.9" if d == "torch" else real(d))
    elif change == "device":
        monkeypatch.setattr(trust, "device_kind", lambda device_type: "cpu riscv64")
    else:
        turbo.version = "1.2.4"
    assert f"its certificate is for other code ({expected.format(old=old)})" in why_passed_over(reg)


def test_a_failing_run_revokes_the_certificate(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A certified sampler that now fails the suite: the run revokes its certificate and ``auto``,
    which chose it before, passes it over saying so."""
    import corerun.plugin.registry as registry_module
    from tests.broken_impls.sampler import IgnoresTemperatureWithTopK as Broken

    class Plugin:
        @hookimpl
        def corerun_samplers(self, register) -> None:
            register("lastless", Broken, capabilities=Broken.capabilities, priority=100)

    reg = Registry.from_environment(allow=[])
    reg.register_module(Plugin(), plugin="lastless", distribution="corerun-lastless", version="0.1")
    monkeypatch.setattr(registry_module, "_default", reg)
    lastless = reg.get("sampler", "lastless")
    trust.record_certificate(lastless, "cpu", {"passed": 10})
    assert reg.select("sampler", "auto", Need("cpu")).name == "lastless"

    done = CliRunner().invoke(cli, ["conformance", "sampler:lastless", "--device", "cpu", "-k", "distribution and top_k"])
    assert done.exit_code == 1, done.output
    assert "its certificate is revoked" in " ".join(done.output.split())
    with caplog.at_level(logging.INFO):
        chosen = reg.select("sampler", "auto", Need("cpu"))
    assert chosen.name == "full"
    why = dict((r.name, w) for r, w in chosen.passed_over)["lastless"]
    assert why.startswith("third-party, its certificate was revoked: `corerun conformance` failed ")
    assert "lastless" in " ".join(r.getMessage() for r in caplog.records)  # the selection log says it
    trust.record_certificate(lastless, "cpu", {"passed": 10})  # a passing run certifies it again
    assert reg.select("sampler", "auto", Need("cpu")).name == "lastless"


def test_only_corerun_distributions_under_an_extra_are_first_party(monkeypatch: pytest.MonkeyPatch) -> None:
    class Metadata:  # what corerun's installed metadata requires
        requires = ['numpy>=1.24', 'transformers>=4.45; extra == "hf"', 'fastapi>=0.110; extra == "default"',
                    'corerun-attention-triton; extra == "triton"', 'Corerun_Sampler.Basic; extra == "samplers"']

    monkeypatch.setattr(trust.md, "distribution", lambda name: Metadata)
    trust.first_party_distributions.cache_clear()
    try:
        assert trust.first_party_distributions() == {"corerun-attention-triton", "corerun-sampler-basic"}
        assert trust.origin("transformers", "transformers") == trust.THIRD_PARTY
    finally:
        trust.first_party_distributions.cache_clear()
