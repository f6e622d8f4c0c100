"""``corerun new quantization NAME`` writes a method that passes the quantization suite unedited: in
process (every GGUF block type it declares, each check against the suite's float64 references), and
installed with pip, through ``corerun conformance quantization:NAME`` and the scaffold's own tests."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from corerun.cli import cli
from corerun.conformance import run
from corerun.scaffold import scaffold
from tests.helpers.thirdparty import Site, check

pytest.importorskip("gguf")

BLOCK_TYPES = 6  # Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K
CHECKS = 4  # matmul, merged, sharded, odd_rows; quantizer_bound runs for the 3 types gguf can quantize


def test_scaffolded_method_passes_the_whole_suite_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = scaffold("quantization", "fresh", tmp_path)
    monkeypatch.syspath_prepend(str(root))
    from corerun_quantization_fresh.method import Method
    from corerun_quantization_fresh.plugin import CAPABILITIES

    results = run("quantization", factory=Method, capabilities=CAPABILITIES, name="fresh")
    assert [r for r in results if r.outcome != "passed"] == []
    assert len(results) == BLOCK_TYPES * CHECKS + 3, [r.id for r in results]
    assert "`quantization: fresh`" in (root / "README.md").read_text()
    for module in [m for m in sys.modules if m.startswith("corerun_quantization_fresh")]:
        monkeypatch.delitem(sys.modules, module)


@pytest.mark.timeout(600)
def test_scaffolded_method_installs_and_passes_corerun_conformance(tmp_path: Path) -> None:
    done = CliRunner().invoke(cli, ["new", "quantization", "foo", "--dir", str(tmp_path / "src")])
    assert done.exit_code == 0, done.output
    assert "corerun conformance quantization:foo" in done.output
    root = tmp_path / "src" / "corerun-quantization-foo"
    site = Site(tmp_path / "site")
    site.install([root])
    env = {"CORERUN_CACHE_DIR": str(tmp_path / "cache")}
    out = " ".join(check(site.corerun(["conformance", "quantization:foo", "-k", "Q4_1"], timeout=300, **env)).split())
    assert re.search(r"\b5 passed|passed: 5\b", out), out  # matmul, merged, sharded, odd_rows, quantizer_bound
    own = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root / "tests"), "-k", "Q8_0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=site.env(**env),
    )
    assert own.returncode == 0 and re.search(r"\b5 passed", own.stdout), own.stdout + own.stderr
