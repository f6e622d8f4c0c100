"""``--model owner/name``: a Hugging Face Hub id, resolved through huggingface_hub to its local snapshot.
Run offline (HF_HUB_OFFLINE=1, a temporary HF_HOME): no network is touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from corerun.models.hub import is_hub_id

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _offline(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


def test_a_hub_id_missing_offline_names_the_cache_and_the_switch(tmp_path: Path) -> None:
    code = (
        "from corerun.cli.options import build_config\n"
        "from corerun.models.errors import ModelLoadError\n"
        "try:\n"
        f"    build_config(None, (), model={HUB_ID!r})\n"
        "except ModelLoadError as exc:\n"
        "    raise SystemExit(str(exc))\n"
    )
    done = _offline(tmp_path, "-c", code)  # what generate, serve and bench call first
    assert done.returncode == 1, done.stderr
    err = " ".join(done.stderr.split())
    assert f"model '{HUB_ID}' is not a folder here and not in the Hugging Face cache {tmp_path / 'hf' / 'hub'}" in err
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in err and "does not exist" not in err


def test_a_cached_hub_id_resolves_to_its_snapshot_offline(tmp_path: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code = f"from corerun.cli.options import build_config; print(build_config(None, (), model={HUB_ID!r}).model)"
    done = _offline(tmp_path, "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(snapshot)
    # `corerun serve --model owner/name` answers to the id, not to the snapshot's commit hash
    code = f"from corerun.cli.options import build_config; print(build_config(None, (), model={HUB_ID!r}).server.served_model_name)"
    done = _offline(tmp_path, "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == HUB_ID
    # the engine resolves it too, so LLM(model=HUB_ID) needs no CLI in front of it
    code = ("from corerun.config import Config; from corerun.runner.construction import model_dir_for; "
            f"print(model_dir_for(Config(model={HUB_ID!r})))")
    done = _offline(tmp_path, "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(snapshot)


def test_what_counts_as_a_hub_id(tmp_path: Path, monkeypatch) -> None:
    assert is_hub_id(HUB_ID) and is_hub_id("Qwen/Qwen2.5-0.5B")
    assert not is_hub_id("models/llama/7b") and not is_hub_id("/abs/path") and not is_hub_id("plain")
    (tmp_path / "owner" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("owner/name")  # a folder that exists here is a folder
