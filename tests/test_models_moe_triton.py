"""The Triton experts kernel (CUDA's), run in Triton's interpreter: equal to every expert applied densely
to every token in float64, scaled by its routing weight (0 where not chosen), for float32, float16 and
bfloat16 inputs, top-k 1, 2 and 4, an expert no token chose and sizes off the kernel's blocks."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is decorated (a CUDA host compiles it)
triton_experts = pytest.importorskip("corerun.models.moe_triton").triton_experts

from corerun.models.moe import route  # noqa: E402
from tests.test_model_moe import E, H, _dense_reference, _experts  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}  # normwise, against float64


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_triton_experts_equal_a_dense_per_expert_reference(top_k: int) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gate, up, down = _experts(seed=4)
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(5), dtype=torch.float64)  # > one block of pairs
    logits = torch.randn(37, E, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    logits[:, 5] = -1e9  # expert 5 gets no token
    weights, ids = route(logits, top_k, renormalize=top_k > 1)
    for dtype, tol in TOLERANCE.items():
        rounded = [[w.to(dtype).double() for w in ws] for ws in (gate, up, down)]  # the reference sees the same inputs
        xr = x.to(dtype).double()
        want = _dense_reference(xr, *rounded, weights, ids)
        stacked_gate_up = torch.stack([torch.cat([g, u]) for g, u in zip(rounded[0], rounded[1])]).to(dtype)
        got = triton_experts(xr.to(dtype).to(device), stacked_gate_up.to(device), torch.stack(rounded[2]).to(dtype).to(device),
                             weights.to(device), ids.to(device))
        assert got.dtype == dtype and got.shape == x.shape
        err = ((got.double().cpu() - want).norm() / want.norm()).item()
        assert err < tol, f"{dtype}, top {top_k}: normwise error {err:.2e} (tolerance {tol:.0e})"


@pytest.mark.timeout(300)
def test_the_experts_and_int_gemm_launches_compile_for_sm_90_without_spills(tmp_path) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(root / "scripts" / "compile_check.py"), "--arch", "90", "--json", str(report)],
                          capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=280)
    if proc.returncode == 3:
        pytest.skip(f"no ptxas for sm_90 here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    launches = json.loads(report.read_text())
    assert {(x["use"], x["dtype"]) for x in launches} == {(u, d) for u in ("gate_up", "down", "w4", "w8") for d in ("fp16", "bf16", "fp32")}
    assert all(x["ok"] and x["figures"]["spill_stores"] == 0 for x in launches)
