"""``scripts/compile_check.py``: every launch the backend fixes compiles for sm_90 without register
spills, at head sizes 64, 128 and 256 in bf16 (fp16, which compiles the same code with another element
type, is in the script's default run), the LoRA shrink and expand at ranks 16 and 128 in bf16 and fp32,
and the check fails on a launch that spills.

It compiles with Triton's bundled ``ptxas`` (no GPU needed) in a process of its own, since this
session's kernels are built for the interpreter.  Skipped, with the reason, where no ``ptxas`` is found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compile_check.py"
HEAD_SIZES = (64, 128, 256)
DTYPES = ("bf16",)
FIXED = {"kv_write_kernel", "unified_attention_kernel", "split_kv_decode_kernel", "split_kv_reduce_kernel"}
LORA_RANKS = (16, 128)  # 128: the triton LoRA kernel's max_rank
MAX_REGISTERS = 255  # a thread's limit on sm_90: more would have spilled


def _ptxas() -> str | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(90).path
    except Exception:
        return None
    return path if path and os.path.exists(path) else None


pytestmark = pytest.mark.skipif(_ptxas() is None, reason="no ptxas for sm_90: Triton's NVIDIA backend (which ships one) is not installed")


def compile_check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    report = tmp_path / "report.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton-cache")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--arch", "90", "--fixed-only", "--json", str(report), *args],
                          capture_output=True, text=True, env=env, timeout=900)
    variants = json.loads(report.read_text())["variants"] if report.exists() else []
    return proc, variants


def test_every_fixed_launch_compiles_for_sm90_without_spills(tmp_path: Path) -> None:
    proc, variants = compile_check(tmp_path, "--kernels", "attention", "--head-sizes", ",".join(map(str, HEAD_SIZES)),
                                   "--dtypes", ",".join(DTYPES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = {(v["kernel"], v["dtype"], v["head_size"]) for v in variants}
    assert seen == {(k, d, h) for k in FIXED for d in DTYPES for h in HEAD_SIZES}
    for v in variants:
        where = f"{v['kernel']} {v['use']} {v['dtype']} hd{v['head_size']} {v['options']}"
        assert v["ok"] and v["error"] is None, where
        assert v["spill_stores"] == 0 and v["spill_loads"] == 0 and v["stack_bytes"] == 0, where
        assert 0 < v["registers"] <= MAX_REGISTERS, where
    # the decode launches at a padded head size of 128 take 8 warps (4 warps spill there: the next test)
    decode_warps = {(v["kernel"], v["head_size"]): v["options"]["num_warps"] for v in variants if v["use"] == "decode"}
    assert decode_warps[("split_kv_decode_kernel", 128)] == decode_warps[("unified_attention_kernel", 128)] == 8
    assert {decode_warps[(k, h)] for k in ("split_kv_decode_kernel", "unified_attention_kernel") for h in (64, 256)} == {4}


def test_lora_launches_compile_for_sm90_without_spills(tmp_path: Path) -> None:
    """The LoRA shrink and expand at ranks 16 and 128 (the declared largest), bf16 and fp32 (fp16 compiles
    bf16's code; the GPU script's full check covers it and rank 64)."""
    proc, variants = compile_check(tmp_path, "--kernels", "lora", "--lora-ranks", ",".join(map(str, LORA_RANKS)),
                                   "--dtypes", "bf16,fp32")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = {(v["kernel"], v["dtype"], v["head_size"]) for v in variants}
    assert seen == {(k, d, r) for k in ("lora_shrink_kernel", "lora_expand_kernel") for d in ("bf16", "fp32")
                    for r in LORA_RANKS}
    for v in variants:
        assert v["ok"] and v["spill_stores"] == v["spill_loads"] == v["stack_bytes"] == 0, v
        assert 0 < v["registers"] <= MAX_REGISTERS, v


def test_the_check_fails_when_a_decode_launch_spills(tmp_path: Path) -> None:
    """4 warps at head size 128 (the launchers' earlier choice) spill in both decode kernels."""
    proc, variants = compile_check(tmp_path, "--kernels", "attention", "--head-sizes", "128", "--dtypes", "bf16",
                                   "--decode-warps", "4")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    decode = {v["kernel"]: v for v in variants if v["use"] == "decode"}
    assert set(decode) == {"split_kv_decode_kernel", "unified_attention_kernel"}
    for v in decode.values():
        assert v["options"]["num_warps"] == 4 and not v["ok"]
        assert v["registers"] == MAX_REGISTERS and v["spill_stores"] > 0 and v["stack_bytes"] > 0, v
    assert "FAILED: 255 registers" in proc.stdout and "2 failed" in proc.stdout
